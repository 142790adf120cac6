"""Layer 3: the pre-encoded training data.

`dataset` reads latent npy + json pairs and batches them (crop/pad, oversampling, a seeded
resumable sampler); `prompts` turns a clip's tags and path into a training prompt
(underfit's prompt templates); `encode_cache` is the content-addressed latent cache of the
`encode` stage.
"""
