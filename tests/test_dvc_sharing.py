"""Sharing artifacts through a DVC remote: push from a reproduced repo, `git clone` elsewhere, fetch
the outputs, and nothing needs recomputing. Against a local-directory remote and a local S3 server."""

import hashlib
import importlib.util
import logging
import re

import pytest
from dvc.repo import Repo
from dvc_project import commit_all, make_project, run

UP_TO_DATE = "Data and pipelines are up to date."
BUCKET = "sa3mlx-share"
S3_KEY, S3_SECRET = "sa3mlx-test-key", "sa3mlx-test-secret"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The project with every stage of dvc.yaml reproduced and committed, once per module."""
    repo = make_project(tmp_path_factory.mktemp("share") / "source")
    run(["dvc", "repro"], repo)
    commit_all(repo, "reproduced")
    return repo


def declared_outs(repo) -> dict[str, bool]:
    """Every output of dvc.yaml (metrics and plots included, templating resolved) -> is it DVC-cached."""
    with Repo(str(repo)) as dvc_repo:
        return {out.def_path: out.use_cache for out in dvc_repo.index.outs}


def digest_tree(path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {p.relative_to(path.parent).as_posix(): hashlib.md5(p.read_bytes()).hexdigest() for p in files}


def push_then_clone(source, remote: str, url: str, clone, config=(), local_config=()):
    """Make `remote` the default, commit, push, check the remote is in sync, and clone the repo.
    `config` goes to the committed .dvc/config, `local_config` to .dvc/config.local on both sides."""
    run(["dvc", "remote", "add", "--force", "-d", remote, url], source)
    for option, value in config:
        run(["dvc", "remote", "modify", remote, option, value], source)
    for option, value in local_config:
        run(["dvc", "remote", "modify", "--local", remote, option, value], source)
    commit_all(source, f"remote {remote}")
    assert "pushed" in run(["dvc", "push"], source)
    assert f"Cache and remote '{remote}' are in sync" in run(["dvc", "status", "--cloud"], source)
    run(["git", "clone", "-q", str(source), str(clone)], clone.parent)
    cached = [out for out, use_cache in declared_outs(source).items() if use_cache]
    assert cached and not any((clone / out).exists() for out in cached)  # git alone does not carry them
    for option, value in local_config:
        run(["dvc", "remote", "modify", "--local", remote, option, value], clone)


def assert_nothing_to_recompute(source, clone):
    outs = declared_outs(source)
    missing = [out for out in outs if not (clone / out).exists()]
    assert not missing, (
        f"outputs neither in git nor in the remote: {missing}; a clone reruns their stages. "
        "Keep machine-local scratch (cache: false, git-ignored) out of dvc.yaml `outs`."
    )
    assert UP_TO_DATE in run(["dvc", "status"], clone)
    assert "Running stage" not in run(["dvc", "repro"], clone)
    for out in outs:
        assert digest_tree(clone / out) == digest_tree(source / out), out


def test_local_remote_push_clone_pull(source, tmp_path):
    clone = tmp_path / "clone"
    push_then_clone(source, "shared-dir", str(tmp_path / "remote"), clone)
    assert list((tmp_path / "remote" / "files" / "md5").iterdir())
    assert "fetched" in run(["dvc", "pull"], clone)
    assert_nothing_to_recompute(source, clone)


@pytest.fixture(scope="module")
def s3_endpoint():
    """An in-memory S3 server (moto) on 127.0.0.1 with one bucket, stopped when the module ends."""
    server_module = pytest.importorskip("moto.server", reason="S3 test needs `moto[server]`")
    boto3 = pytest.importorskip("boto3", reason="S3 test needs boto3")
    if importlib.util.find_spec("dvc_s3") is None:
        pytest.skip("S3 test needs the `dvc-s3` plugin")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    requests_log = logging.getLogger("werkzeug")
    level = requests_log.level
    requests_log.setLevel(logging.WARNING)  # one INFO line per object otherwise
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        client = boto3.client(
            "s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET
        )
        client.create_bucket(Bucket=BUCKET)
        yield url, client
    finally:
        server.stop()
        requests_log.setLevel(level)


def test_s3_remote_push_clone_repro_pull(source, tmp_path, s3_endpoint):
    url, client = s3_endpoint
    clone = tmp_path / "clone"
    credentials = (("access_key_id", S3_KEY), ("secret_access_key", S3_SECRET))
    push_then_clone(source, "s3", f"s3://{BUCKET}/sa3mlx", clone, [("endpointurl", url)], credentials)
    assert client.list_objects_v2(Bucket=BUCKET, Prefix="sa3mlx/files/md5/")["KeyCount"] > 0
    # endpoint in the shared config, credentials only in the git-ignored .dvc/config.local
    shared = (clone / ".dvc" / "config").read_text()
    assert url in shared and S3_SECRET not in shared
    assert S3_SECRET in (clone / ".dvc" / "config.local").read_text()
    assert ".dvc/config.local" not in run(["git", "ls-files", ".dvc"], source)
    assert "Running stage" not in run(["dvc", "repro", "--pull"], clone)
    assert_nothing_to_recompute(source, clone)


def test_two_hosts_encode_their_shares_a_third_clone_runs_nothing(tmp_path):
    """docs/distributed.md "Encoding across hosts", command for command: hosts A and B encode one
    `encode.shard` each and push their share of the encode cache to one remote; A assembles the
    unsharded output with every file a cache hit and pushes it; a third clone pulls, and
    `dvc repro encode` runs nothing. The latents equal a one-host encode's, byte for byte."""
    origin = make_project(tmp_path / "origin")
    run(["dvc", "repro", "convert", "normalize"], origin)
    run(["dvc", "remote", "add", "-d", "shared", str(tmp_path / "remote")], origin)
    commit_all(origin, "inputs")
    run(["dvc", "push"], origin)
    run(["git", "clone", "-q", "--bare", str(origin), str(tmp_path / "central.git")], tmp_path)
    hosts = {}
    for i, name in enumerate(("a", "b")):
        host = hosts[name] = tmp_path / name
        run(["git", "clone", "-q", str(tmp_path / "central.git"), str(host)], tmp_path)
        for cmd in (["git", "config", "user.email", "tests@sa3mlx.invalid"], ["git", "config", "user.name", "t"]):
            run(cmd, host)
        run(["dvc", "pull", "convert", "normalize"], host)
        summary = run(["python", "stages/encode.py", "--shard", f"{i}/2"], host)
        assert re.search(r"Done in .+?: [1-9]\d* encoded, 0 skipped", summary)
        run(["bash", "-c", f"mkdir -p shares/{i} && cp -r data/encode_cache shares/{i}/encode_cache"], host)
        run(["dvc", "add", f"shares/{i}/encode_cache"], host)
        run(["git", "add", f"shares/{i}"], host)
        run(["git", "commit", "-q", "-m", f"encode share {i}/2"], host)
        run(["git", "pull", "-q", "--no-rebase", "--no-edit"], host)  # B merges A's share commit
        run(["git", "push", "-q"], host)
        run(["dvc", "push"], host)
    a = hosts["a"]
    run(["git", "pull", "-q", "--no-rebase", "--no-edit"], a)
    run(["dvc", "pull", "-R", "shares"], a)
    run(["bash", "-c", "cp -rn shares/*/encode_cache/. data/encode_cache/"], a)
    assembled = run(["dvc", "repro", "encode"], a)
    assert re.search(r"Done in .+?: 0 encoded, [1-9]\d* skipped, 0 errors", assembled)
    run(["git", "add", "dvc.lock"], a)
    run(["git", "commit", "-q", "-m", "latents"], a)
    run(["git", "push", "-q"], a)
    run(["dvc", "push"], a)
    third = tmp_path / "c"
    run(["git", "clone", "-q", str(tmp_path / "central.git"), str(third)], tmp_path)
    run(["dvc", "pull", "convert", "normalize", "encode"], third)
    assert "Running stage" not in run(["dvc", "repro", "encode"], third)
    run(["dvc", "repro", "encode"], origin)  # one host, no shards
    assert digest_tree(third / "data" / "latents") == digest_tree(origin / "data" / "latents")
