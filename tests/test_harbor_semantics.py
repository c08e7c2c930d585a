"""Harbor / Terminal-Bench 2 tasks keep their meaning: every field of Harbor's task model honoured or refused by
name, Harbor's defaults, compose environments with several services, a network policy per phase, and verifiers
that need network reported instead of scored 0 (real Docker; the "internet" is a server this test starts on a
Docker network it creates)."""

import asyncio
import textwrap
import uuid

import pytest

from jaxrl_term.tasks.formats import export_harbor, load_tasks, save_parquet
from jaxrl_term.tasks.task import TaskFormatError, resolve_env

BASE = "jaxrl-term/base:trixie"


def harbor_dir(root, name="t", toml="", *, dockerfile=f"FROM {BASE}\nWORKDIR /app\n", compose=None,
               test_sh=None, solve_sh="echo done > /app/out.txt\n", files=None):
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "instruction.md").write_text("Write done to /app/out.txt.\n")
    (d / "task.toml").write_text(textwrap.dedent(toml))
    if dockerfile is not None:
        (d / "environment" / "Dockerfile").write_text(dockerfile)
    if compose is not None:
        (d / "environment" / "docker-compose.yaml").write_text(textwrap.dedent(compose))
    for rel, text in (files or {}).items():
        (d / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "environment" / rel).write_text(text)
    (d / "tests" / "test.sh").write_text(test_sh or textwrap.dedent("""\
        #!/bin/bash
        if grep -qx done /app/out.txt 2>/dev/null; then echo 1 > /logs/verifier/reward.txt
        else echo 0 > /logs/verifier/reward.txt; fi
        """))
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve_sh)
    return d


# ------------------------------------------------------------------------------------ the task model (no Docker)


def test_harbor_defaults_are_harbors(tmp_path):
    t = load_tasks(harbor_dir(tmp_path, toml='version = "1.0"\n'))[0]
    e = t.environment
    assert e.allow_internet is True and e.baseline.mode == "public"
    assert (e.cpus, e.memory_mb, e.storage_mb, e.build_timeout_s) == (1, 2048, 10240, 600.0)
    assert t.test_timeout_s == 600.0 and t.agent_timeout_s == 600.0
    assert t.phase_network("agent").mode == t.phase_network("verifier").mode == "public"
    assert t.metadata["harbor_version"] == "1.0"


def test_every_field_is_read(tmp_path):
    t = load_tasks(harbor_dir(tmp_path, toml="""\
        schema_version = "1.1"
        source = "tb2"
        [task]
        name = "org/t"
        [metadata]
        difficulty = "hard"
        tags = ["x"]
        [verifier]
        timeout_sec = 77.0
        env = { EXPECTED = "v", TOKEN = "${JRT_TEST_TOKEN:-fallback}" }
        network_mode = "public"
        [agent]
        timeout_sec = 99
        network_mode = "no-network"
        [solution]
        env = { SOLVE_MODE = "fast" }
        [environment]
        build_timeout_sec = 30
        cpus = 2
        memory = "1G"
        storage_mb = 4096
        allow_internet = false
        env = { GREETING = "hi" }
        [environment.healthcheck]
        command = "true"
        retries = 5
        interval_sec = 1
        """))[0]
    e = t.environment
    assert (e.cpus, e.memory_mb, e.storage_mb, e.build_timeout_s) == (2, 1024, 4096, 30.0)
    assert e.allow_internet is False and e.env == {"GREETING": "hi"}
    assert e.healthcheck.command == "true" and e.healthcheck.retries == 5 and e.healthcheck.interval_s == 1
    assert t.phase_network("agent").mode == "no-network" and t.phase_network("verifier").mode == "public"
    assert t.verifier_env["EXPECTED"] == "v" and t.solution_env == {"SOLVE_MODE": "fast"}
    assert (t.test_timeout_s, t.agent_timeout_s) == (77.0, 99.0)
    assert t.metadata["package"] == {"name": "org/t"} and t.metadata["harbor_source"] == "tb2"
    assert resolve_env(t.verifier_env, "w", {})["TOKEN"] == "fallback"
    assert resolve_env(t.verifier_env, "w", {"JRT_TEST_TOKEN": "s3"})["TOKEN"] == "s3"
    with pytest.raises(TaskFormatError, match=r"NEEDED.*not set"):
        resolve_env({"K": "${NEEDED}"}, "task x: [verifier]", {})


def test_every_field_round_trips_through_parquet_and_harbor_export(tmp_path):
    src = harbor_dir(tmp_path, toml="""\
        [verifier]
        env = { A = "1" }
        network_mode = "public"
        [agent]
        network_mode = "no-network"
        [solution]
        env = { B = "2" }
        [environment]
        allow_internet = false
        env = { C = "${X:-3}" }
        storage_mb = 512
        [environment.healthcheck]
        command = "test -d /app"
        """, compose="""\
        services:
          web:
            image: jaxrl-term/base:trixie
            command: ["sleep", "infinity"]
        """)
    t = load_tasks(src)[0]
    again = load_tasks(save_parquet([t], tmp_path / "t.parquet"))[0]
    assert again == t
    export_harbor([t], tmp_path / "out")
    back = load_tasks(tmp_path / "out" / "t")[0]
    for field in ("agent_network", "verifier_network", "verifier_env", "solution_env"):
        assert getattr(back, field) == getattr(t, field), field
    for field in ("network", "env", "storage_mb", "compose", "healthcheck", "allow_internet"):
        assert getattr(back.environment, field) == getattr(t.environment, field), field


@pytest.mark.parametrize("toml, match", [
    ("[environment]\ngpus = 1\n", r"\[environment\] gpus = 1.*cannot be honoured"),
    ("[environment]\ngpu_types = ['H100']\n", r"gpu_types"),
    ("[environment]\nmcp_servers = [{name = 'x', url = 'http://x'}]\n", r"mcp_servers.*not supported"),
    ("[environment]\nskills_dir = '/skills'\n", r"skills_dir.*not supported"),
    ("[agent]\nuser = 'agent'\n", r"\[agent\] user"),
    ("[verifier]\nuser = 1000\n", r"\[verifier\] user"),
    ("[environment]\nallowed_hosts = ['pypi.org']\n", r"allowlist.*not supported"),
    ("[verifier]\nnetwork_mode = 'allowlist'\nallowed_hosts = ['x.org']\n", r"\[verifier\].*allowlist"),
    ("[agent]\nnetwork_mode = 'public'\nallowed_hosts = ['x.org']\n", r"allowed_hosts is only valid"),
    ("[environment]\nnetwork_mode = 'internet'\n", r"network_mode='internet'"),
    ("[environment]\ncpu = 2\n", r"\[environment\] cpu is not a field"),
    ("[verifer]\ntimeout_sec = 1\n", r"'verifer' is not a field"),
    ("[environment]\nallow_internet = 'yes'\n", r"allow_internet must be true or false"),
    ("[verifier]\nenv = { A = ['x'] }\n", r"\[verifier\] env must be a table"),
])
def test_fields_we_cannot_honour_are_refused_by_name(tmp_path, toml, match):
    with pytest.raises(TaskFormatError, match=match) as e:
        load_tasks(harbor_dir(tmp_path, toml=toml))
    assert "task.toml" in str(e.value)


@pytest.mark.parametrize("compose, match", [
    ("services:\n  web:\n    image: x\n    ports: ['80:80']\n", r"services\.web\.ports is not supported"),
    ("services:\n  web:\n    image: x\n    volumes: ['/:/host']\n", r"services\.web\.volumes"),
    ("services:\n  web:\n    image: x\n    privileged: true\n", r"services\.web\.privileged"),
    ("services:\n  main:\n    command: ['x']\n", r"services\.main\.command is not supported"),
    ("services:\n  web:\n    image: x\nnetworks:\n  n: {}\n", r"top-level 'networks'"),
    ("services:\n  web: {}\n", r"services\.web needs 'build' or 'image'"),
    ("services:\n  a:\n    image: x\n    depends_on: [b]\n  b:\n    image: x\n    depends_on: [a]\n", r"cycle"),
    ("services:\n  a:\n    image: x\n    depends_on: [nope]\n", r"names 'nope'"),
    ("services:\n  a:\n    build: ../outside\n", None),
])
def test_compose_keys_outside_the_subset_are_refused(tmp_path, compose, match):
    if match is None:  # a build context outside environment/ is refused when the service is built
        from jaxrl_term.sandbox.compose import context_files

        with pytest.raises(TaskFormatError, match="inside environment/"):
            context_files({}, None, "../outside", "w")
        return
    with pytest.raises(TaskFormatError, match=match) as e:
        load_tasks(harbor_dir(tmp_path, compose=compose))
    assert "docker-compose.yaml" in str(e.value)


def test_phase_overrides():
    from jaxrl_term.tasks.builtin import builtin_tasks
    from jaxrl_term.tasks.env import phase_policies

    t = builtin_tasks(1)[0]  # our own tasks: no network unless asked
    assert {k: p.mode for k, p in phase_policies(t).items()} == {"agent": "no-network", "verifier": "no-network"}
    assert phase_policies(t, verifier="public")["verifier"].online
    with pytest.raises(ValueError, match="sandbox.agent_network='on'"):
        phase_policies(t, agent="on")


def test_tasks_that_cannot_run_as_they_ask_are_refused_before_training(tmp_path, monkeypatch):
    from jaxrl_term.tasks.env import check_tasks_open, task_problems

    monkeypatch.delenv("JRT_UNSET_VAR", raising=False)
    split = load_tasks(harbor_dir(tmp_path, "split", toml="[environment]\nallow_internet = false\n"
                                                          "[verifier]\nnetwork_mode = 'public'\n"))[0]
    secret = load_tasks(harbor_dir(tmp_path, "secret", toml="[environment]\nenv = { K = '${JRT_UNSET_VAR}' }\n"))[0]
    comp = load_tasks(harbor_dir(tmp_path, "comp", compose="services:\n  w:\n    image: x\n"))[0]
    assert task_problems([split], {}, "docker") == []
    probs = task_problems([split, secret, comp], {}, "local")
    assert len(probs) == 3
    assert "split" in probs[0] and "host's own network" in probs[0]
    assert "JRT_UNSET_VAR" in probs[1] and "[environment]" in probs[1]
    assert "compose environment needs sandbox=docker" in probs[2]
    assert task_problems([split], {"verifier_network": "none"}, "local") == []  # the run decided for it
    probs = task_problems([split], {"verifier_network": "public"}, "local")
    assert len(probs) == 1 and "cannot switch network between phases" in probs[0]
    with pytest.raises(TaskFormatError, match="3 task"):
        check_tasks_open([split, secret, comp], {}, "local")


# ------------------------------------------------------------------------------------------- real Docker


def _run(coro):
    return asyncio.run(coro)


def _leftovers(docker_client, label):
    cs = docker_client.containers.list(all=True, filters={"label": label})
    ns = docker_client.networks.list(filters={"label": label})
    return cs, ns


@pytest.fixture
def tools_network(docker_client):
    """A Docker network this test creates with an HTTP server on it named ``tools`` serving ``checktool``: the
    stand-in for the internet a TB2 verifier installs its test tools from."""
    name = f"jrt-test-net-{uuid.uuid4().hex[:8]}"
    net = docker_client.networks.create(name, driver="bridge", labels={"jaxrl_term.test": "1"})
    script = ("mkdir -p /srv && printf '#!/bin/sh\\ngrep -qx done \"$1\" || { echo \"checktool: $1: \"; cat \"$1\"; "
              "exit 1; }\\n' > /srv/checktool && cd /srv && exec python3 -m http.server 8000")
    srv = docker_client.containers.run(BASE, ["sh", "-c", script], detach=True, network=name,
                                       networking_config={name: docker_client.api.create_endpoint_config(
                                           aliases=["tools"])}, labels={"jaxrl_term.test": "1"})
    try:
        for _ in range(100):  # serving (the positive control)
            r = docker_client.containers.run(BASE, ["sh", "-c", "curl -fsS http://tools:8000/checktool"],
                                             network=name, remove=True)
            if b"checktool" in r:
                break
        yield name
    finally:
        srv.remove(force=True)
        net.remove()


TB2_TEST_SH = textwrap.dedent("""\
    #!/bin/bash
    # like Terminal-Bench 2's test.sh: fetch the test tools, then test
    if ! curl -fsS "$TOOLS_URL/checktool" -o /usr/local/bin/checktool; then
      echo 0 > /logs/verifier/reward.txt; exit 0
    fi
    chmod +x /usr/local/bin/checktool
    if checktool /app/out.txt; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
    """)


def test_compose_env_and_second_service_reachable(docker_client, tmp_path, monkeypatch):
    """allow_internet, [environment] env (a ${VAR} from the host), [verifier] env, a second compose service
    reachable from the agent's shell and from the verifier, its healthcheck awaited; nothing left behind."""
    from jaxrl_term.sandbox.docker import LABEL_RUN, RUN_ID
    from jaxrl_term.tasks.check import check_task
    from jaxrl_term.tasks.env import open_task_sandbox

    monkeypatch.setenv("JRT_TEST_SECRET", "s3cret")
    d = harbor_dir(tmp_path, "compose-task", toml="""\
        [environment]
        allow_internet = true
        env = { GREETING = "hello", SECRET = "${JRT_TEST_SECRET}" }
        [verifier]
        env = { EXPECTED = "from-verifier" }
        """, compose="""\
        services:
          main:
            environment:
              FROM_COMPOSE: "main-${GREETING}"
            depends_on: [web]
          web:
            build:
              context: ./web
            environment:
              WEB_GREETING: "${GREETING}"
            command: ["sh", "-c", "mkdir -p /srv && echo \\"web says $$WEB_GREETING\\" > /srv/index.html && cd /srv && exec python3 -m http.server 8080"]
            healthcheck:
              test: ["CMD", "python3", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8080')"]
              interval: 1s
              retries: 30
        """, files={"web/Dockerfile": f"FROM {BASE}\nRUN echo built > /built\n"},
        test_sh=textwrap.dedent("""\
            #!/bin/bash
            curl -fsS http://web:8080/ > /tmp/page || { echo 0 > /logs/verifier/reward.txt; exit 0; }
            if [ "$EXPECTED" = from-verifier ] && grep -q 'web says hello' /tmp/page && grep -qx done /app/out.txt
            then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
            """))
    task = load_tasks(d)[0]
    assert task.environment.compose and task.phase_network("agent").online

    async def go():
        async with open_task_sandbox(task) as sb:
            r = await sb.run("echo $GREETING $SECRET $FROM_COMPOSE; curl -fsS http://web:8080/")
            assert r.exit_code == 0, r
            assert "hello s3cret main-hello" in r.output and "web says hello" in r.output
            r = await sb.run("echo EXPECTED=$EXPECTED")  # the verifier's env is the verifier's only
            assert r.output.strip() == "EXPECTED="
            cs, ns = _leftovers(docker_client, f"{LABEL_RUN}={RUN_ID}")
            assert len(cs) == 2 and len(ns) == 1  # main + web, one network per sandbox
            assert {c.labels.get("jaxrl_term.service") for c in cs} == {None, "web"}
        return await check_task(task, "oracle"), await check_task(task, "nop")

    oracle, nop = _run(go())
    assert oracle.score == 1.0 and not oracle.broken, oracle
    assert nop.score == 0.0 and not nop.broken, nop
    cs, ns = _leftovers(docker_client, f"{LABEL_RUN}={RUN_ID}")
    assert not cs and not ns


def test_compose_without_internet_reaches_its_services_only(docker_client, tmp_path, tools_network):
    from jaxrl_term.tasks.env import open_task_sandbox

    task = load_tasks(harbor_dir(tmp_path, "offline-compose", toml="[environment]\nallow_internet = false\n",
                                 compose="""\
        services:
          web:
            image: jaxrl-term/base:trixie
            command: ["python3", "-m", "http.server", "8080"]
        """))[0]

    async def go():
        async with open_task_sandbox(task, public_network=tools_network) as sb:
            r = await sb.run("for i in $(seq 50); do curl -fsS -o /dev/null http://web:8080/ && break; sleep 0.2; "
                             "done && echo WEB-OK")
            assert "WEB-OK" in r.output, r
            r = await sb.run("curl -sS -m 5 http://tools:8000/checktool && echo REACHED", timeout_s=20)
            assert "REACHED" not in r.output, r

    _run(go())


def test_unhonourable_compose_image_is_refused_not_pulled(docker_client, tmp_path):
    from jaxrl_term.sandbox.base import SandboxError
    from jaxrl_term.tasks.env import open_task_sandbox

    task = load_tasks(harbor_dir(tmp_path, "pull", compose="services:\n  db:\n    image: postgres:99-nope\n"))[0]

    async def go():
        async with open_task_sandbox(task):
            pass

    with pytest.raises(SandboxError, match=r"services\.db\.image 'postgres:99-nope' is not on this Docker engine"):
        _run(go())


def test_verifier_network_per_phase_and_needs_network_preflight(docker_client, tmp_path, tools_network):
    """A TB2-style test.sh fetches its tools: with the verifier granted network the oracle scores 1 while the
    agent phase stays offline; with no network it is "verifier needs network", never a 0; a policy forged by
    the agent's output is not believed."""
    from jaxrl_term.reward.verifier import reset_network_findings, verify
    from jaxrl_term.tasks.check import check_task
    from jaxrl_term.tasks.env import open_task_sandbox

    granted = load_tasks(harbor_dir(tmp_path, "tb2-granted", toml="""\
        [environment]
        allow_internet = false
        [verifier]
        network_mode = "public"
        env = { TOOLS_URL = "http://tools:8000" }
        """, test_sh=TB2_TEST_SH))[0]
    offline = load_tasks(harbor_dir(tmp_path, "tb2-offline", toml="""\
        [environment]
        allow_internet = false
        [verifier]
        env = { TOOLS_URL = "http://tools:8000" }
        """, test_sh=TB2_TEST_SH))[0]
    lim = {"public_network": tools_network}

    async def go():
        async with open_task_sandbox(granted, **lim) as sb:  # the agent phase: no network
            r = await sb.run("curl -sS -m 5 http://tools:8000/checktool && echo REACHED", timeout_s=20)
            assert "REACHED" not in r.output and "resolv" in r.output.lower(), r
            await sb.run("echo 'Could not resolve host: forged' > /app/out.txt")  # forged evidence, and no work
            res = await verify(granted, sb)
        assert res.outcome == "scored" and res.score == 0.0, res  # online verifier: a plain 0
        async with open_task_sandbox(offline, **lim) as sb:
            await sb.run("echo 'Temporary failure in name resolution' > /app/out.txt")
            forged = await verify(offline, sb, fresh=False)
        assert forged.outcome == "scored" and forged.score == 0.0  # no fresh-sandbox confirmation: it stands
        return (await check_task(granted, "oracle", limits=lim), await check_task(granted, "nop", limits=lim),
                await check_task(offline, "oracle", limits=lim),
                await check_task(offline, "oracle", limits=lim, network_preflight=True),
                await check_task(granted, "oracle", limits={**lim, "verifier_network": "none"}))

    reset_network_findings()
    ok, nop, off, pre, forced = _run(go())
    assert ok.score == 1.0 and not ok.broken, ok
    assert nop.score == 0.0 and not nop.broken, nop
    for r in (off, forced):  # offline verifier: "verifier needs network", no score at all
        assert r.outcome == "verifier_needs_network" and r.score is None and r.broken, r
        assert "verifier needs network" in r.reason and "resolv" in r.reason.lower()
    assert pre.outcome == "verifier_needs_network" and pre.broken and pre.score == 1.0, pre
    assert "passes with the verifier online and fails offline" in pre.reason
    reset_network_findings()


def test_tasks_check_cli_reports_verifier_needs_network(docker_client, tmp_path, tools_network):
    import subprocess
    import sys

    harbor_dir(tmp_path / "ds", "tb2-offline", toml="""\
        [environment]
        allow_internet = false
        [verifier]
        env = { TOOLS_URL = "http://tools:8000" }
        """, test_sh=TB2_TEST_SH)
    out = subprocess.run([sys.executable, "-m", "jaxrl_term.tasks", "check", str(tmp_path / "ds"), "--agent",
                          "oracle", "--public-network", tools_network, "--network-preflight",
                          "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "verifier needs network: tb2-offline" in out.stdout
    import json

    s = json.loads((tmp_path / "r.json").read_text())
    assert s["verifier_needs_network"] == ["tb2-offline"] and s["broken"][0]["task"] == "tb2-offline"


def test_reaper_removes_a_killed_runs_compose_services_and_network(docker_client, tmp_path):
    import subprocess
    import sys

    from jaxrl_term.sandbox.docker import reap

    d = harbor_dir(tmp_path, "compose-reap", toml="[environment]\nallow_internet = false\n", compose="""\
        services:
          web:
            image: jaxrl-term/base:trixie
            command: ["sleep", "infinity"]
        """)
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent("""\
        import asyncio, os, signal, sys
        from jaxrl_term.tasks.env import open_task_sandbox
        from jaxrl_term.tasks.formats import load_tasks
        async def main():
            async with open_task_sandbox(load_tasks(sys.argv[1])[0], labels={"jaxrl_term.test": "compose-reap"}):
                print("ready", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        asyncio.run(main())
        """))
    proc = subprocess.run([sys.executable, str(script), str(d)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9 and "ready" in proc.stdout, proc.stderr
    cs, ns = _leftovers(docker_client, "jaxrl_term.test=compose-reap")
    assert len(cs) == 2 and len(ns) == 1  # the killed process could not clean up: main, web and their network
    reap()
    assert _leftovers(docker_client, "jaxrl_term.test=compose-reap") == ([], [])
