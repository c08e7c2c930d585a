"""The locally built base images: Python, pytest and the environment, in containers with no network."""

import subprocess
import sys
import time

import pytest

from conftest import need
from jaxrl_term.sandbox.images import BASE_IMAGES, RECIPE_LABEL

pytestmark = pytest.mark.docker


def _run(client, image, cmd):
    out = client.containers.run(image, ["sh", "-c", cmd], network_mode="none", remove=True, stderr=True)
    return out.decode()


def test_trixie_runs_python_and_pytest_without_network(docker_client):
    from conftest import host_tcp_server

    with host_tcp_server() as (addrs, port):  # a server this test started on the host
        out = _run(docker_client, "jaxrl-term/base:trixie",
                   "python3 -c 'import sys; print(sys.version_info[:2])' && pytest --version && "
                   f"(curl -sS -m 3 http://{addrs[0]}:{port} >/dev/null 2>&1 && echo NET || echo NONET)")
    assert "(3, 13)" in out
    assert "pytest" in out
    assert out.strip().endswith("NONET")


def test_base_images_carry_tools_env_and_recipe_label(docker_client):
    for spec in BASE_IMAGES.values():
        img = docker_client.images.get(spec.name)
        assert img.labels.get(RECIPE_LABEL)
        env = dict(e.split("=", 1) for e in img.attrs["Config"]["Env"])
        assert env["PIP_BREAK_SYSTEM_PACKAGES"] == "1"
        out = _run(docker_client, spec.name, "for t in tmux git curl python3 pip3 pytest; do command -v $t; done")
        assert len(out.split()) == 6, out
    out = _run(docker_client, "jaxrl-term/base:bookworm", "python3 -c 'import sys; print(sys.version_info[:2])'")
    assert "(3, 11)" in out


def test_setup_is_idempotent_and_fast_when_cached(docker_client):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jaxrl_term.sandbox.images", "setup", "--require"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("cached") == len(BASE_IMAGES)
    assert time.monotonic() - t0 < 30


def test_extra_ca_bundle_is_installed_in_the_images(docker_client):
    from pathlib import Path

    from jaxrl_term.sandbox.images import HOST_CA_BUNDLE

    host = Path(HOST_CA_BUNDLE)
    need(host.is_file(), "this host has no CA bundle, so setup installed none")
    out = _run(docker_client, "jaxrl-term/base:trixie",
               "sha256sum /usr/local/share/ca-certificates/jaxrl-term-extra-ca.crt; echo $PIP_CERT")
    import hashlib

    assert hashlib.sha256(host.read_bytes()).hexdigest() in out
    assert "/etc/ssl/certs/ca-certificates.crt" in out


def test_mirror_and_ca_bundle_options(tmp_path):
    from jaxrl_term.sandbox import images

    assert images.apt_mirror().startswith("http")
    with pytest.raises(FileNotFoundError, match="extra CA bundle .*not found"):
        images.resolve_ca_bundle(str(tmp_path / "nope.pem"))
    assert images.resolve_ca_bundle("none") is None
