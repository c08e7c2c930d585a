"""Shared fixtures. Eight fake CPU devices are set up before JAX is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

collect_ignore = ["fixtures"]  # task fixtures carry their own tests: they run inside sandboxes, not here

REPO = Path(__file__).resolve().parents[1]


def _shared_dir() -> Path:
    """The project's shared/ folder (datasets, references): beside the checkout, or JAXRL_TERM_SHARED."""
    candidates = [os.environ.get("JAXRL_TERM_SHARED"), REPO.parent / "shared", Path("/work/shared")]
    for c in candidates:
        if c and (Path(c) / "datasets").is_dir():
            return Path(c)
    return REPO.parent / "shared"


SHARED = _shared_dir()
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(condition: bool, why: str) -> None:
    """Skip locally when a prerequisite is missing; under CI=true a missing prerequisite is a failure."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true and a prerequisite is missing: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def docker_client():
    from jaxrl_term.sandbox.images import DockerUnavailable, docker_client

    try:
        client = docker_client()
    except DockerUnavailable as e:
        need(False, f"Docker engine: {e} (run `python -m jaxrl_term.sandbox.images setup`)")
    return client


@pytest.fixture(params=["docker", "local"])
def backend(request):
    """Run a test on both sandbox backends: real Docker containers and real bubblewrap."""
    if request.param == "docker":
        request.getfixturevalue("docker_client")
    else:
        import shutil

        need(shutil.which("bwrap") is not None, "bubblewrap (bwrap) is not installed")
    return request.param


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    from jaxrl_term.model.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok_tiny"))


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory):
    from jaxrl_term.model.tokenizer import build_qwen3_tokenizer

    return build_qwen3_tokenizer(tmp_path_factory.mktemp("tok_qwen3"))


@pytest.fixture(scope="session", autouse=True)
def no_sandbox_left_behind():
    """After the whole suite, no sandbox container or local sandbox directory of this test process (or of a dead
    one) remains."""
    yield
    import json as _json

    try:
        from jaxrl_term.sandbox.local_dirs import base_dir

        leftovers = []
        for d in base_dir().iterdir():
            rec = d / "owner.json"
            if rec.is_file() and _json.loads(rec.read_text()).get("owner", {}).get("jaxrl_term.pid") == str(os.getpid()):
                leftovers.append(d.name)
        assert not leftovers, f"local sandbox directories left behind: {leftovers}"
    except ImportError:
        pass
    try:
        from jaxrl_term.sandbox.docker import LABEL_HOST, LABEL_PID, LABEL_RUN, _pid_alive, client

        left = client().containers.list(all=True, filters={"label": LABEL_RUN})
    except Exception:  # noqa: BLE001 - no Docker here: nothing can be left behind
        return
    import socket

    mine = [c.name for c in left if (c.labels or {}).get(LABEL_HOST) == socket.gethostname()
            and (int((c.labels or {}).get(LABEL_PID, 0)) == os.getpid()
                 or not _pid_alive(int((c.labels or {}).get(LABEL_PID, 0))))]
    assert not mine, f"sandbox containers left behind: {mine}"
