"""Shared fixtures. Eight fake CPU devices are set up before JAX is imported anywhere."""

import contextlib
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


def run_stacked(argv, *, timeout: float, env=None, **kw):
    """``subprocess.run(argv, capture_output=True, text=True)``, but a child that runs past ``timeout`` is made
    to print every thread's Python stack (faulthandler on SIGABRT) and the test fails with that and its log
    tail, instead of a bare timeout: a rare hang then says where it was."""
    import signal
    import subprocess

    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # not even SIGABRT: a process stuck in the kernel (state, wait channel)
            proc.kill()
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                out, err = "", ""
            import pathlib

            status = pathlib.Path(f"/proc/{proc.pid}/status")
            err = (err or "") + (status.read_text() if status.exists() else "")
        pytest.fail(f"{' '.join(map(str, argv[:4]))} ... ran past {timeout:.0f}s; its stacks and log:\n"
                    f"{(err or '')[-20000:]}\n--- stdout ---\n{(out or '')[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


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


@contextlib.contextmanager
def host_tcp_server():
    """A TCP server this test starts on every host interface: yields (addresses, port), the host's non-loopback
    addresses (the Docker bridge gateway first) where a sandbox *with* network would reach it. Proving a sandbox
    has no network means failing to reach this server, never an outside address."""
    import socket
    import subprocess
    import threading

    srv = socket.create_server(("0.0.0.0", 0))
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")  # curl-valid
                conn.close()
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    addrs = []
    try:
        out = subprocess.run(["docker", "network", "inspect", "bridge", "-f",
                              "{{range .IPAM.Config}}{{.Gateway}} {{end}}"], capture_output=True, text=True)
        addrs += out.stdout.split()
    except OSError:
        pass
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True)
    addrs += [a for a in out.stdout.split() if ":" not in a and a not in addrs]
    try:
        with socket.create_connection((addrs[0], port), timeout=3) as c:  # positive control: it is reachable
            assert c.recv(12) == b"HTTP/1.0 200"
        yield addrs, port
    finally:
        stop.set()
        t.join()
        srv.close()
