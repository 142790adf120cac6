"""Synthesis of the demo clips (seeded numpy): voices, drums, effects and the eight clips.

Used by tools/make_demo_audio.py, which writes them in their formats with their tags.
"""

import numpy as np

# ---------------------------------------------------------------- synthesis


def midi_hz(note):
    return 440.0 * 2.0 ** ((note - 69) / 12.0)


def seconds_per_beat(bpm):
    return 60.0 / bpm


def decay(n, rate, per_second):
    return np.exp(-np.arange(n) / rate * per_second)


def adsr(n, rate, attack, release, sustain=1.0, hold_decay=0.0):
    """Linear attack, optional exponential fall towards sustain, linear release."""
    t = np.arange(n) / rate
    env = np.minimum(t / max(attack, 1e-4), 1.0)
    if hold_decay:
        env *= sustain + (1.0 - sustain) * np.exp(-t * hold_decay)
    tail = int(release * rate)
    if 0 < tail < n:
        env[-tail:] *= np.linspace(1.0, 0.0, tail)
    return env


def partials(freq, n, rate, amps, detune=1.0, stretch=0.0, decays=None):
    """Additive tone: amps[k] scales harmonic k+1, skipped above ~0.45 * rate."""
    t = np.arange(n) / rate
    out = np.zeros(n)
    for k, amp in enumerate(amps, start=1):
        f = freq * detune * k * (1.0 + stretch * k * k)
        if f > 0.45 * rate:
            break
        wave = amp * np.sin(2 * np.pi * f * t)
        if decays is not None:
            wave *= np.exp(-t * decays * k)
        out += wave
    return out


def saw_amps(count):
    return [1.0 / k for k in range(1, count + 1)]


def square_amps(count):
    return [1.0 / k if k % 2 else 0.0 for k in range(1, count + 1)]


def piano(freq, dur, rate, rng):
    n = int((dur + 0.6) * rate)
    amps = [1.0 / k**1.6 for k in range(1, 13)]
    tone = partials(freq, n, rate, amps, stretch=0.0004, decays=0.9)
    return tone * adsr(n, rate, 0.004, 0.5, sustain=0.35, hold_decay=2.5)


def pad(freq, dur, rate, rng):
    n = int((dur + 1.0) * rate)
    amps = saw_amps(10)
    tone = sum(partials(freq, n, rate, amps, detune=d) for d in (0.995, 1.0, 1.005))
    return tone * adsr(n, rate, 0.8, 1.0) / 3.0


def bass(freq, dur, rate, rng):
    n = int(dur * rate)
    tone = partials(freq, n, rate, saw_amps(8), decays=1.5)
    return tone * adsr(n, rate, 0.005, 0.03, sustain=0.5, hold_decay=6.0)


def pluck(freq, dur, rate, rng):
    n = int((dur + 0.2) * rate)
    tone = partials(freq, n, rate, square_amps(15), decays=2.0)
    return tone * adsr(n, rate, 0.002, 0.05, sustain=0.0, hold_decay=9.0)


def stab(freq, dur, rate, rng):
    n = int(dur * rate)
    tone = partials(freq, n, rate, saw_amps(12), decays=4.0)
    return tone * adsr(n, rate, 0.003, 0.02, sustain=0.0, hold_decay=14.0)


def kick(rate, rng):
    n = int(0.4 * rate)
    t = np.arange(n) / rate
    freq = 48.0 + 110.0 * np.exp(-t * 28.0)
    body = np.sin(2 * np.pi * np.cumsum(freq) / rate) * decay(n, rate, 7.0)
    click = rng.standard_normal(n) * decay(n, rate, 300.0) * 0.3
    return body + click


def snare(rate, rng):
    n = int(0.25 * rate)
    t = np.arange(n) / rate
    noise = np.diff(rng.standard_normal(n + 1)) * 0.5 * decay(n, rate, 16.0)
    tone = np.sin(2 * np.pi * 190.0 * t) * decay(n, rate, 25.0)
    return 0.7 * noise + 0.5 * tone


def hat(rate, rng, open_hat=False):
    n = int((0.3 if open_hat else 0.06) * rate)
    noise = np.diff(rng.standard_normal(n + 2), n=2) * 0.25
    return noise * decay(n, rate, 9.0 if open_hat else 70.0)


def clap(rate, rng):
    n = int(0.2 * rate)
    noise = np.diff(rng.standard_normal(n + 1)) * 0.5
    env = decay(n, rate, 22.0)
    for start in (0.0, 0.011, 0.022):  # three quick bursts, like hands
        i = int(start * rate)
        env[i:] += 0.6 * decay(n - i, rate, 200.0)
    return noise * env


def noise_sweep(seconds, rate, rng, low_hz, high_hz):
    """Band-passed noise whose centre glides from low_hz to high_hz and back."""
    size, hop = 2048, 1024
    n = int(seconds * rate)
    frames = n // hop + 2
    out = np.zeros((frames + 1) * hop)
    window = np.hanning(size + 1)[:-1]
    bins = np.fft.rfftfreq(size, 1.0 / rate)
    for i in range(frames):
        pos = i / max(frames - 1, 1)
        centre = low_hz * (high_hz / low_hz) ** np.sin(np.pi * pos)
        shape = np.exp(-0.5 * (np.log2(np.maximum(bins, 1.0) / centre) / 0.4) ** 2)
        spectrum = shape * (rng.standard_normal(bins.size) + 1j * rng.standard_normal(bins.size))
        out[i * hop : i * hop + size] += np.fft.irfft(spectrum, size) * window
    return out[:n] / np.max(np.abs(out[:n]))


def reverb(x, rate, rng, seconds=1.6, mix=0.25):
    """Convolve each channel with seeded, exponentially decaying noise."""
    n = int(seconds * rate)
    out = np.empty((x.shape[0] + n - 1, x.shape[1]))
    size = 1 << int(np.ceil(np.log2(out.shape[0])))
    for ch in range(x.shape[1]):
        ir = rng.standard_normal(n) * decay(n, rate, 4.0)
        ir /= np.sqrt(np.sum(ir**2))
        wet = np.fft.irfft(np.fft.rfft(x[:, ch], size) * np.fft.rfft(ir, size), size)
        out[:, ch] = wet[: out.shape[0]] * mix
    out[: x.shape[0]] += x * (1.0 - mix)
    return out


def echo(x, rate, delay_s, feedback, taps=5):
    """Ping-pong delay: repeats alternate between left and right."""
    d = int(delay_s * rate)
    out = np.zeros((x.shape[0] + d * taps, 2))
    out[: x.shape[0]] += x
    mono = x.mean(axis=1)
    for tap in range(1, taps + 1):
        out[tap * d : tap * d + mono.size, tap % 2] += mono * feedback**tap
    return out


def pan(mono, position):
    """Equal-power pan, position -1 (left) .. 1 (right)."""
    angle = (position + 1.0) * np.pi / 4.0
    return np.stack([mono * np.cos(angle), mono * np.sin(angle)], axis=1)


def place(buffer, sound, start_s, rate, gain=1.0, position=0.0):
    i = int(round(start_s * rate))
    if i >= buffer.shape[0]:
        return
    part = pan(sound, position) if buffer.ndim == 2 else sound
    part = part[: buffer.shape[0] - i]
    buffer[i : i + part.shape[0]] += gain * part


def play(buffer, voice, notes, rate, rng, gain=1.0, position=0.0):
    """notes: (start_s, dur_s, midi_note, velocity)."""
    for start, dur, note, velocity in notes:
        place(buffer, voice(midi_hz(note), dur, rate, rng), start, rate, gain * velocity, position)


def chord_notes(chords, beat, beats_per_chord):
    notes = []
    for i, chord in enumerate(chords):
        for note in chord:
            notes.append((i * beats_per_chord * beat, beats_per_chord * beat, note, 1.0))
    return notes


def drum_pattern(buffer, rate, rng, bpm, bars, style):
    beat = seconds_per_beat(bpm)
    for step in range(bars * 16):
        t = step * beat / 4
        if style == "funk" and step % 2:
            t += beat / 4 * 0.16  # swing the off sixteenths
        if (style == "house" and step % 4 == 0) or (style == "funk" and step % 16 in (0, 7, 10)):
            place(buffer, kick(rate, rng), t, rate, 0.9)
        if step % 8 == 4:
            drum = clap(rate, rng) if style == "house" else snare(rate, rng)
            place(buffer, drum, t, rate, 0.6, position=-0.1)
        if style == "house" and step % 4 == 2:
            place(buffer, hat(rate, rng, open_hat=True), t, rate, 0.35, position=0.3)
        elif style == "funk" or step % 2 == 0:
            accent = 0.3 if step % 4 == 0 else 0.18
            place(buffer, hat(rate, rng), t, rate, accent, position=0.3)


# -------------------------------------------------------------------- clips


def empty(seconds, rate, channels):
    n = int(round(seconds * rate))
    return np.zeros((n, 2)) if channels == 2 else np.zeros(n)


def clip_house_drums(rate, rng):
    bpm, bars = 124, 4
    out = empty(bars * 4 * seconds_per_beat(bpm), rate, 2)
    drum_pattern(out, rate, rng, bpm, bars, "house")
    return out


def clip_bass_line(rate, rng):
    bpm, bars = 110, 4
    beat = seconds_per_beat(bpm)
    riff = [45, 45, 57, 45, 48, 45, 52, 43]  # a minor, eighth notes
    notes = []
    for bar in range(bars):
        shift = -2 if bar == 2 else 0
        for i, note in enumerate(riff):
            notes.append(((bar * 8 + i) * beat / 2, beat / 2 * 0.85, note + shift, 1.0 if i % 2 == 0 else 0.7))
    out = empty(bars * 4 * beat, rate, 1)
    play(out, bass, notes, rate, rng)
    return out


def clip_piano_chords(rate, rng):
    bpm = 90
    beat = seconds_per_beat(bpm)
    chords = [[50, 53, 57, 60], [43, 53, 59, 62], [48, 52, 55, 59], [45, 52, 55, 60]]  # ii V I vi in c
    out = empty(4 * 4 * beat + 1.5, rate, 2)
    for i, (start, dur, note, _) in enumerate(chord_notes(chords, beat, 4)):
        velocity = 0.6 + 0.3 * rng.random()
        strum = (i % 4) * 0.012
        play(out, piano, [(start + strum, dur * 0.95, note, velocity)], rate, rng, position=(note - 52) / 20)
    return reverb(out, rate, rng, seconds=1.2, mix=0.2)[: out.shape[0]]


def clip_ambient(rate, rng):
    seconds = 20.0
    out = empty(seconds, rate, 2)
    chords = [[50, 57, 62, 65], [46, 53, 58, 62], [48, 55, 60, 64], [45, 52, 57, 60]]
    for start, dur, note, _ in chord_notes(chords, 1.0, 4.6):
        play(out, pad, [(start, dur, note, 0.5)], rate, rng, position=0.5 * np.sin(note))
    sweep = noise_sweep(seconds, rate, rng, 300.0, 5000.0)
    out += pan(sweep, 0.0) * 0.25 * np.sin(np.linspace(0, np.pi, sweep.size))[:, None]
    return reverb(out, rate, rng, seconds=2.5, mix=0.35)[: out.shape[0]]


def clip_funk_groove(rate, rng):
    bpm, bars = 118, 8
    beat = seconds_per_beat(bpm)
    out = empty(bars * 4 * beat, rate, 2)
    drum_pattern(out, rate, rng, bpm, bars, "funk")
    riff = [(0, 40), (3, 40), (6, 52), (8, 43), (10, 45), (14, 47)]  # e minor, sixteenth steps
    notes = [((bar * 16 + s) * beat / 4, beat / 4 * 1.6, n, 0.9) for bar in range(bars) for s, n in riff]
    play(out, bass, notes, rate, rng, gain=0.8)
    stabs = [64, 67, 71, 74]
    hits = [((bar * 16 + s) * beat / 4, beat / 4, n, 0.25) for bar in range(bars) for s in (2, 7, 12) for n in stabs]
    play(out, stab, hits, rate, rng, position=0.35)
    return out


def clip_arp_lead(rate, rng):
    bpm, bars = 128, 4
    beat = seconds_per_beat(bpm)
    shapes = [[57, 60, 64, 69], [53, 57, 60, 65], [48, 52, 55, 60], [55, 59, 62, 67]]
    notes = []
    for bar, shape in enumerate(shapes[:bars]):
        order = shape + [shape[-1] + 12] + shape[::-1][1:4]  # up then down
        for i in range(16):
            notes.append(((bar * 16 + i) * beat / 4, beat / 4, order[i % len(order)], 0.7 + 0.3 * (i % 4 == 0)))
    out = empty(bars * 4 * beat, rate, 1)
    play(out, pluck, notes, rate, rng)
    return out


def clip_dub_chords(rate, rng):
    bpm, bars = 120, 3
    beat = seconds_per_beat(bpm)
    chord = [50, 53, 57, 60]  # d minor 7
    hits = [((bar * 16 + s) * beat / 4, beat / 4, n, 0.5) for bar in range(bars) for s in (2, 10) for n in chord]
    dry = empty(bars * 4 * beat, rate, 2)
    play(dry, stab, hits, rate, rng)
    wet = echo(dry, rate, beat * 0.75, 0.55)[: dry.shape[0]]
    return reverb(wet, rate, rng, seconds=1.5, mix=0.3)[: dry.shape[0]]


def clip_lofi_melody(rate, rng):
    bpm = 80
    beat = seconds_per_beat(bpm)
    phrase = [
        (0, 1.5, 64),
        (1.5, 0.5, 67),
        (2, 1, 69),
        (3, 1, 67),
        (4, 2, 64),
        (6, 1, 62),
        (7, 1, 60),
        (8, 1.5, 62),
        (9.5, 0.5, 64),
        (10, 2, 67),
        (12, 3, 60),
    ]
    notes = [(b * beat + 0.03 * (b % 1 > 0), d * beat, n, 0.6 + 0.2 * rng.random()) for b, d, n in phrase]
    out = empty(16 * beat, rate, 1)
    play(out, piano, notes, rate, rng)
    hiss = np.diff(rng.standard_normal(out.size + 1)) * 0.004  # tape hiss
    crackle = (rng.random(out.size) > 0.9994) * rng.standard_normal(out.size) * 0.15
    return out * 0.5 + hiss + crackle
