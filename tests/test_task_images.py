"""Task images: registry bases mapped to local ones, content-hash cache, the CA bundle, build errors."""

import asyncio
import time

import pytest

from jaxrl_term.sandbox.images import (
    DEFAULT_IMAGE_MAP,
    ImageBuildError,
    ImageBuilder,
    build_task_image,
    resolve_ca_bundle,
)

pytestmark = pytest.mark.docker

DOCKERFILE = """FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620
WORKDIR /app
COPY data/input.txt /app/input.txt
COPY run.sh /app/run.sh
RUN pip install --no-cache-dir --quiet six==1.17.0
"""
FILES = {"data/input.txt": b"hello from the build context\n", "run.sh": (b"#!/bin/sh\necho ran\n", 0o755)}


def test_registry_base_is_mapped_built_with_context_and_ca_then_cached(docker_client):
    tag, built = build_task_image(docker_client, DOCKERFILE, FILES, ca_bundle=resolve_ca_bundle("auto"))
    out = docker_client.containers.run(
        tag, ["sh", "-c", "cat input.txt; ./run.sh; python3 -c 'import six; print(six.__version__)'; pwd"],
        network_mode="none", remove=True,
    ).decode()
    assert out == "hello from the build context\nran\n1.17.0\n/app\n"
    t0 = time.monotonic()
    again, built_again = build_task_image(docker_client, DOCKERFILE, FILES, ca_bundle=resolve_ca_bundle("auto"))
    assert again == tag and not built_again and time.monotonic() - t0 < 5
    other, _ = build_task_image(docker_client, DOCKERFILE, {**FILES, "data/input.txt": b"changed\n"},
                                ca_bundle=resolve_ca_bundle("auto"))
    assert other != tag  # the context is part of the cache key


def test_build_error_returns_the_failing_step_and_its_log(docker_client):
    df = "FROM ubuntu:24.04\nRUN echo step-one-ok\nRUN echo about-to-fail && ls /nonexistent-dir\n"
    with pytest.raises(ImageBuildError) as e:
        build_task_image(docker_client, df)
    assert "RUN echo about-to-fail" in e.value.step
    assert "about-to-fail" in e.value.log and "nonexistent-dir" in e.value.log
    assert "step-one-ok" not in e.value.log  # only the failing step's output


def test_unmapped_registry_image_names_the_config_key(docker_client):
    with pytest.raises(ImageBuildError, match=r"FROM golang:1.22-alpine: not available locally .*sandbox\.image_map"):
        build_task_image(docker_client, "FROM golang:1.22-alpine\nRUN true\n")


def test_multi_stage_references_are_not_remapped(docker_client):
    df = ("FROM python:3.13-slim AS builder\nRUN echo built > /artifact\n"
          "FROM ubuntu:24.04\nCOPY --from=builder /artifact /artifact\n")
    tag, _ = build_task_image(docker_client, df, image_map=DEFAULT_IMAGE_MAP)
    out = docker_client.containers.run(tag, ["cat", "/artifact"], network_mode="none", remove=True)
    assert out == b"built\n"


def test_concurrent_requests_build_once(docker_client):
    df = f"FROM debian:bookworm\nRUN echo {time.time_ns()} > /stamp\n"  # fresh content: not cached

    async def main():
        builder = ImageBuilder(ca_bundle="none")
        return await asyncio.gather(*(builder.ensure(df) for _ in range(3))), builder

    tags, builder = asyncio.run(main())
    assert len(set(tags)) == 1 and builder.built == 1
    stamps = docker_client.containers.run(tags[0], ["cat", "/stamp"], remove=True, network_mode="none")
    assert stamps.strip().isdigit()
