"""Server benchmark: mlx-lm's OpenAI-compatible server with and without the mlx-lm plug-in.

Both servers (``python -m mlx_lm server`` and ``python -m mlx_batched_decode.serve``, same
arguments) serve the same random-weight model, written once to a temporary folder with mlx-lm's
own save functions and a word-level tokenizer (``mlx_batched_decode.tools.model_folder``), on
127.0.0.1 on a free port, one server at a time. N clients each send one streaming greedy
``/v1/completions`` request at the same moment, with a prompt of 1-2k tokens (seeded random
words: one word is one token) and the same ``--max-tokens``; the server's batched path
(``BatchGenerator``) prefills them and decodes them together.

Measured per run, from the clients' side (every streamed chunk is timed; with this tokenizer a
chunk is one token):

- TTFT: time from sending a request to its first token, median and max over the clients (mostly
  prefill, which the plug-in leaves to mlx-lm);
- decode tokens/s: tokens after each request's first / (last token of any request - first
  token of any request);
- steady tokens/s: tokens that arrive while all N requests are decoding / that window's length.

Every request's text must be the same with and without the plug-in (greedy), or the script exits
with status 1 after saving. A request that fails (a connection reset, a timeout, an HTTP error) is
counted against its server, with the first error, in the table and the JSON, and the run goes on;
the measures are over the answered requests, and the texts are compared where both servers
answered. The plug-in server's own count of attention calls served by the op is read from its
log when it stops. Runs alternate between the two servers (``--rounds``); the table
shows the median over rounds. Results: ``results/server.json``.

The model is small because MLX's float32 CPU matmuls run at a few GFLOPS here and mlx-lm
prefills with full causal attention: a Llama with 2 layers, hidden 128, 8 query heads and 8
key/value heads of dim 64 (8 KiB of keys and values per token and layer in float32), MLP 256,
vocabulary 1024. Prefilling 8 prompts of 1-2k tokens still takes about half a minute per server
on 2 cores.

With ``--arrivals`` it replays requests arriving over time instead (``server_arrivals.py``):
mlx_lm.server at its defaults against this project's server (``python -m
mlx_batched_decode.serve``) at its defaults, then with ``--kv-bits 8`` and with a draft model
(the target's first layer), on a burst of long prompts beside decoding requests and on a seeded
trace of 32 requests; and the trace behind a shared 1,024-token system prompt, slot layout
against paged with prefix sharing (prefill tokens saved, from ``/metrics``). Results:
``results/server_arrivals.json``. ``--native-only``: the native server at its defaults alone, on the
burst and the trace (for A/B runs of two builds, ``ab_compare.py``). ``--output``: another name
under ``results/``.

With ``--burst`` it times the server tests' burst of clients (``tests.support.server_burst``: 8
requests with 1,500-token prompts, then, 1 s later, 64 short completions whose clients all
connect at once) on the server tests' model (``SERVED_LLAMA_SLIDING``): the plug-in's server
against mlx-lm's with the same listen backlog (``mlx_lm_server_backlog.py``; stock
``mlx_lm.server`` resets most of the burst), each started afresh for every run, as a new user's
first load finds it. Every request must be answered and the two servers' texts equal, or the
script exits with status 1 after saving. Results: ``results/server_burst.json``.

    python benchmarks/bench_server.py                      # 8 clients, prompts 1024-2048, 64 tokens
    python benchmarks/bench_server.py --clients 16 --rounds 3
    python benchmarks/bench_server.py --arrivals           # burst, trace, flags (about 15 minutes)
    python benchmarks/bench_server.py --arrivals --native-only   # native burst and trace only
    python benchmarks/bench_server.py --burst --rounds 3   # the server tests' burst (about a minute)
    python benchmarks/bench_server.py --features --rounds 3   # request fields' costs (``server_features.py``)

With ``--features`` it measures what sampling knobs, prompt logprobs and ``n`` cost the native
server's engine, each against its plain twin in the same run (``server_features.py``; ``--vocab``
for a larger vocabulary than the model's 1,024). Results: ``results/server_features.json``.
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.*

from mlx_batched_decode.tools.local_server import running_server, sse_chunks  # noqa: E402
from mlx_batched_decode.tools.model_folder import SPECIAL_TOKENS, save_model_folder, word  # noqa: E402
from tests.support.mlx_lm_models import SERVED_LLAMA_SLIDING  # noqa: E402
from tests.support import server_burst  # noqa: E402

from common import machine, print_table, save  # noqa: E402

CONFIG = dict(
    model_type="llama",
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    vocab_size=1024,
    tie_word_embeddings=False,
)
SERVERS = {
    "mlx-lm": [sys.executable, "-m", "mlx_lm", "server"],
    "mlx-lm + plug-in": [sys.executable, "-m", "mlx_batched_decode.serve", "--engine", "mlx-lm"],
}
NATIVE = [sys.executable, "-m", "mlx_batched_decode.serve"]
BURST_SERVERS = {
    "mlx-lm": [sys.executable, str(Path(__file__).with_name("mlx_lm_server_backlog.py"))],
    "mlx-lm + plug-in": SERVERS["mlx-lm + plug-in"],
}
# The server tests' bound on a burst's request, doubled: a client a full backlog leaves in SYN
# retries gives up here and is counted as failed.
BURST_REQUEST_TIMEOUT_S = 120
STARTUP_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 1800


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (N)")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        nargs=2,
        default=[1024, 2048],
        metavar=("MIN", "MAX"),
        help="prompt lengths are drawn uniformly from MIN..MAX",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each server, alternated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arrivals", action="store_true",
                        help="replay requests arriving over time (burst, trace, flags)")
    parser.add_argument("--arrival-rate", type=float, default=0.5, help="the trace's requests/s")
    parser.add_argument("--native-only", action="store_true",
                        help="with --arrivals: only the native server at its defaults, burst and trace "
                             "(no mlx_lm.server, no ratios to it; for A/B runs of this package)")
    parser.add_argument("--output", help="results/<name>.json (default server, with --arrivals "
                        "server_arrivals, with --burst server_burst)")
    parser.add_argument("--features", action="store_true",
                        help="what sampling knobs, prompt logprobs and n cost the engine")
    parser.add_argument("--vocab", type=int, default=CONFIG["vocab_size"],
                        help="the model's vocabulary with --features")
    parser.add_argument("--burst", action="store_true",
                        help="the server tests' burst of clients, each server started afresh")
    return parser.parse_args()


def _stream_completion(port, prompt, max_tokens, start):
    """One streaming greedy completion after ``start`` is set: send time, chunk times, text."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    body = json.dumps(
        {
            "model": "default_model",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    start.wait()
    sent = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    times, text, tokens = [], "", None
    for chunk in sse_chunks(response):
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk["choices"] and chunk["choices"][0]["text"]:
            times.append(time.perf_counter())
            text += chunk["choices"][0]["text"]
    connection.close()
    return {"sent": sent, "times": times, "text": text, "tokens": tokens}


def _run_clients(port, prompts, max_tokens):
    """All clients at once; returns their results in prompt order (None where a request failed)
    and the errors, as ``(request, message)`` in prompt order."""
    start = threading.Event()
    results = [None] * len(prompts)
    errors = {}

    def client(i):
        try:
            results[i] = _stream_completion(port, prompts[i], max_tokens, start)
        except Exception as e:  # recorded against the server, with the request it belongs to
            errors[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    start.set()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S)
    for i, r in enumerate(results):
        if r is None and i not in errors:
            errors[i] = f"no response within {REQUEST_TIMEOUT_S} s"
    return results, sorted(errors.items())


def _measure(results):
    results = [r for r in results if r is not None and r["times"]]
    if not results:
        return {}
    firsts = [r["times"][0] for r in results]
    lasts = [r["times"][-1] for r in results]
    ttfts = [r["times"][0] - r["sent"] for r in results]
    decode_tokens = sum(r["tokens"] - 1 for r in results)
    steady_start, steady_end = max(firsts), min(lasts)
    steady_tokens = sum(steady_start < t <= steady_end for r in results for t in r["times"])
    return {
        "ttft_median_s": statistics.median(ttfts),
        "ttft_max_s": max(ttfts),
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / (max(lasts) - min(firsts)),
        "steady_tokens_per_s": (
            steady_tokens / (steady_end - steady_start) if steady_end > steady_start else None
        ),
        "wall_s": max(lasts) - min(r["sent"] for r in results),
    }


def _served_calls(log_text):
    marker = "batched_decode_attention served "
    for line in log_text.splitlines():
        if marker in line:
            return int(line.split(marker)[1].split()[0])
    return None


def _failed_cell(row):
    """The table's count of failed requests, with the first one's kind (the JSON and the line
    under the table give its message)."""
    if not row["first_error"]:
        return str(row["failed_requests"])
    return f"{row['failed_requests']} ({row['first_error'].split(': ')[1]})"


def _mismatched(texts, clients):
    """Requests whose text differs between runs; a failed request (None) is left out."""
    return [i for i in range(clients) if len({run[i] for run in texts if run[i] is not None}) > 1]


def _draft_folder(model_dir, path):
    """A draft model folder: the target's first layer (its embedding, norm and head too) and
    its tokenizer."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load, save_config, save_model

    from mlx_batched_decode.tools.random_model import random_model

    target, _ = load(str(model_dir))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    draft = random_model(dict(CONFIG, num_hidden_layers=1), seed=0)
    shared = dict(tree_flatten(target.parameters()))
    draft.load_weights([(name, shared[name]) for name, _ in tree_flatten(draft.parameters())])
    mx.eval(draft.parameters())
    path.mkdir(parents=True)
    save_model(path, draft)
    save_config({**config, "num_hidden_layers": 1}, path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, path / name)
    return path


def metric_value(port, name):
    """An unlabelled metric's value from the server's ``/metrics`` (0 when absent)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/metrics")
    for line in connection.getresponse().read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def main_arrivals(args):
    import server_arrivals

    vocab = CONFIG["vocab_size"]
    rng = random.Random(args.seed)
    system = " ".join(word(rng.randrange(len(SPECIAL_TOKENS), vocab)) for _ in range(1024))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model_folder(CONFIG, Path(tmp, "model"), seed=args.seed)
        draft_dir = _draft_folder(model_dir, Path(tmp, "draft"))
        runs = [
            ("mlx_lm.server", SERVERS["mlx-lm"], [], ("burst", "trace")),
            ("native", NATIVE, [], ("burst", "trace")),
            ("native --kv-bits 8", NATIVE, ["--kv-bits", "8"], ("trace",)),
            ("native --draft-model", NATIVE, ["--draft-model", str(draft_dir)], ("trace",)),
            ("native", NATIVE, [], ("shared",)),
            ("native --kv-layout paged", NATIVE, ["--kv-layout", "paged"], ("shared",)),
        ]
        if args.native_only:
            runs = [("native", NATIVE, [], ("burst", "trace"))]
        for name, command, flags, scenarios in runs:
            print(f"{name}: {', '.join(scenarios)} ...", file=sys.stderr, flush=True)
            full = [*command, "--model", str(model_dir), "--log-level", "WARNING", *flags]
            with running_server(full, Path(tmp, "server.log"), STARTUP_TIMEOUT_S,
                                STOP_TIMEOUT_S) as (port, _):
                # Warm-up: one short request pays the one-time costs.
                server_arrivals.stream(port, "w9 w10", 2, server_arrivals.Timed(0.0))
                for scenario in scenarios:
                    if scenario == "burst":
                        row = server_arrivals.burst(port, vocab, args.seed)
                    else:
                        prefix = system if scenario == "shared" else ""
                        row = server_arrivals.trace_row(scenario, port, vocab, args.seed,
                                                        args.arrival_rate, prefix)
                    row["server"] = name
                    if command is NATIVE:
                        row["prefix_hit_tokens"] = metric_value(port, "mbd_prefix_hit_tokens_total")
                        row["prompt_tokens"] = metric_value(port, "mbd_prompt_tokens_total")
                        drafted = metric_value(port, "mbd_draft_tokens_total")
                        if drafted:
                            accepted = metric_value(port, "mbd_accepted_draft_tokens_total")
                            row["acceptance"] = accepted / drafted
                    rows.append(row)
                    print(f"  {scenario}: {row.get('seconds', row.get('largest_gap_s')):.2f} s, "
                          f"{row['failed']} failed", file=sys.stderr, flush=True)

    def row_of(server, scenario):
        return next(r for r in rows if r["server"] == server and r["scenario"] == scenario)

    if args.native_only:
        peer_burst = peer_trace = None
        equal = {}
    else:
        peer_burst, peer_trace = row_of("mlx_lm.server", "burst"), row_of("mlx_lm.server", "trace")
        equal = {
            "native = mlx_lm.server (trace)": row_of("native", "trace")["texts"] == peer_trace["texts"],
            "native = mlx_lm.server (burst)": row_of("native", "burst")["texts"] == peer_burst["texts"],
            "draft = native (trace)": row_of("native --draft-model", "trace")["texts"]
            == row_of("native", "trace")["texts"],
        }
    for row in rows:
        if row["scenario"] == "burst":
            row["gap_over_step"] = row["largest_gap_s"] / row["step_during_prefill_s"]
            if peer_burst:
                row["gap_vs_mlx_lm"] = row["largest_gap_s"] / peer_burst["largest_gap_s"]
        elif row["scenario"] == "trace" and peer_trace:
            for key in ("seconds", "ttft_p50_s", "itl_p99_s"):
                row[f"{key}_vs_mlx_lm"] = row[key] / peer_trace[key]
    print(f"model: {CONFIG}, float32; trace at {args.arrival_rate} requests/s")
    print_table(rows, [
        ("server", "server", "{}"), ("scenario", "scenario", "{}"), ("failed", "failed", "{}"),
        ("largest_gap_s", "largest gap s", "{:.2f}"), ("step_during_prefill_s", "step s", "{:.3f}"),
        ("gap_vs_mlx_lm", "gap vs mlx-lm", "{:.2f}x"), ("gap_over_step", "gap / step", "{:.2f}"),
        ("seconds", "seconds", "{:.1f}"), ("seconds_vs_mlx_lm", "time vs mlx-lm", "{:.2f}x"),
        ("ttft_p50_s", "TTFT p50 s", "{:.2f}"), ("ttft_p50_s_vs_mlx_lm", "vs mlx-lm", "{:.2f}x"),
        ("itl_p50_s", "ITL p50 s", "{:.3f}"), ("itl_p99_s", "ITL p99 s", "{:.3f}"),
        ("itl_p99_s_vs_mlx_lm", "vs mlx-lm", "{:.2f}x"),
        ("prefix_hit_tokens", "prefix hits", "{:.0f}"), ("acceptance", "accepted", "{:.0%}"),
    ])
    for label, same in equal.items():
        print(f"{label}: {'identical texts' if same else 'TEXTS DIFFER'}")
    for row in rows:
        row.pop("texts")
    path = save(args.output or "server_arrivals", {"machine": machine(), "config": CONFIG, "args": vars(args),
                                    "rows": rows, "texts_equal": equal})
    print(f"saved {path}")
    return 0 if all(equal.values()) else 1


def main_burst(args):
    """The server tests' burst against each server of ``BURST_SERVERS``, in turns over rounds."""
    vocab = SERVED_LLAMA_SLIDING["vocab_size"]
    runs, texts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model_folder(SERVED_LLAMA_SLIDING, Path(tmp, "model"), seed=3)
        for round_ in range(args.rounds):
            order = list(BURST_SERVERS) if round_ % 2 == 0 else list(BURST_SERVERS)[::-1]
            for name in order:
                print(f"round {round_ + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
                log_path = Path(tmp, "server.log")
                command = [*BURST_SERVERS[name], "--model", str(model_dir), "--log-level", "WARNING"]
                with running_server(command, log_path, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S) as (port, _):
                    result = server_burst.new_user_burst(port, vocab, BURST_REQUEST_TIMEOUT_S)
                outcomes = result.long + result.short
                texts.append([o.text if o.answered else None for o in outcomes])
                failed = [f"request {i}: {o.error}" for i, o in enumerate(outcomes) if not o.answered]
                runs.append({"server": name, "round": round_, "wall_s": result.wall_s,
                             "failed_requests": len(failed), "first_error": next(iter(failed), None),
                             "served_attention_calls": _served_calls(log_path.read_text())})

    rows = []
    for name in BURST_SERVERS:
        mine = [r for r in runs if r["server"] == name]
        walls = [r["wall_s"] for r in mine]
        rows.append({"server": name, "rounds": len(mine), "wall_s": statistics.median(walls),
                     "wall_range": f"{min(walls):.1f}-{max(walls):.1f}",
                     "failed_requests": sum(r["failed_requests"] for r in mine),
                     "first_error": next((r["first_error"] for r in mine if r["first_error"]), None),
                     "served_attention_calls": mine[-1]["served_attention_calls"]})
    for row in rows:
        row["wall_vs_mlx_lm"] = row["wall_s"] / rows[0]["wall_s"]
    requests = len(texts[0])
    mismatched = _mismatched(texts, requests)
    print(f"the server tests' burst: {server_burst.LONG_REQUESTS} prompts of "
          f"{server_burst.LONG_PROMPT_TOKENS:,} tokens ({server_burst.LONG_MAX_TOKENS} new tokens "
          f"each), {server_burst.PAUSE_S:g} s later {server_burst.BURST} short ones "
          f"({server_burst.SHORT_MAX_TOKENS} new tokens), greedy; a fresh server per run; model: "
          f"{SERVED_LLAMA_SLIDING['num_hidden_layers']}-layer Llama, one sliding-window layer, "
          f"head dim {SERVED_LLAMA_SLIDING['head_dim']}, float32")
    print_table(
        [{**row, "failed_cell": _failed_cell(row)} for row in rows],
        [
            ("server", "server", "{}"),
            ("wall_s", "burst wall s (median)", "{:.2f}"),
            ("wall_range", "rounds", "{}"),
            ("wall_vs_mlx_lm", "vs mlx-lm", "{:.2f}x"),
            ("served_attention_calls", "op calls", "{}"),
            ("failed_cell", "failed (first error)", "{}"),
        ],
    )
    path = save(args.output or "server_burst", {"machine": machine(), "config": SERVED_LLAMA_SLIDING,
                                 "args": vars(args), "runs": runs, "summary": rows,
                                 "texts_equal": not mismatched})
    print(f"saved {path}")
    failed = sum(row["failed_requests"] for row in rows)
    if failed or mismatched:
        print(f"FAILED: {failed} requests unanswered, requests {mismatched} differ between runs",
              file=sys.stderr)
        return 1
    print(f"OK: all {requests} requests answered in every run, the same texts from both servers")
    return 0


def main_features(args):
    import server_features

    rows = server_features.run(args.rounds, args.vocab, args.seed)
    print(
        f"the native server's engine, in process; model: {CONFIG['num_hidden_layers']}-layer "
        f"Llama, hidden {CONFIG['hidden_size']}, vocabulary {args.vocab}, float32; median of "
        f"{args.rounds} alternating rounds"
    )
    print_table(
        rows,
        [
            ("case", "case", "{}"),
            ("with_s", "with (s)", "{:.4f}"),
            ("without_s", "plain twin (s)", "{:.4f}"),
            ("ratio", "ratio", "{:.3f}x"),
            ("floor_ratio", "floor ratio", "{:.3f}x"),
            ("prompt_tokens_fed", "prompt fed, n=4", "{}"),
            ("prompt_tokens_fed_n1", "prompt fed, n=1", "{}"),
        ],
    )
    print("knobs: a decode step of 32 requests with their own seed, top_k, min_p, penalties and "
          "logit_bias / 32 greedy; prompt logprobs: time to first token of a 1,024-token prompt "
          "with / without (floor: the last layer and the head over every prompt row, nothing "
          "after); n: time to all 4 choices' first tokens / n=1")
    path = save(args.output or "server_features",
                {"machine": machine(), "config": dict(CONFIG, vocab_size=args.vocab),
                 "args": vars(args), "rows": rows})
    print(f"saved {path}")
    return 0


def main():
    args = _parse_args()
    if args.features:
        return main_features(args)
    if args.arrivals:
        return main_arrivals(args)
    if args.burst:
        return main_burst(args)
    rng = random.Random(args.seed)
    words = range(len(SPECIAL_TOKENS), CONFIG["vocab_size"])
    lengths = [rng.randint(*args.prompt_tokens) for _ in range(args.clients)]
    prompts = [" ".join(word(rng.choice(words)) for _ in range(n)) for n in lengths]
    runs, texts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model_folder(CONFIG, Path(tmp, "model"), seed=args.seed)
        for round_ in range(args.rounds):
            order = list(SERVERS) if round_ % 2 == 0 else list(SERVERS)[::-1]
            for name in order:
                log_path = Path(tmp, "server.log")
                print(f"round {round_ + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
                command = [*SERVERS[name], "--model", str(model_dir), "--log-level", "WARNING"]
                with running_server(command, log_path, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S) as (port, _):
                    # Warm-up: the first request pays one-time costs (model load, graph set-up).
                    _, warm_up_errors = _run_clients(port, [prompts[0][:200]], 2)
                    results, errors = _run_clients(port, prompts, args.max_tokens)
                for _, error in warm_up_errors:
                    print(f"  {name}: the warm-up request failed: {error}", file=sys.stderr)
                texts.append([r and r["text"] for r in results])
                runs.append(
                    {
                        "server": name,
                        "round": round_,
                        **_measure(results),
                        "failed_requests": len(errors),
                        "first_error": (
                            f"request {errors[0][0]}: {errors[0][1]}" if errors else None
                        ),
                        "served_attention_calls": _served_calls(log_path.read_text()),
                    }
                )

    mismatched = _mismatched(texts, args.clients)
    rows = []
    for name in SERVERS:
        mine = [r for r in runs if r["server"] == name]
        row = {"server": name, "clients": args.clients, "rounds": len(mine)}
        for key in ("ttft_median_s", "ttft_max_s", "decode_tokens_per_s", "steady_tokens_per_s"):
            values = [r[key] for r in mine if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        row["served_attention_calls"] = mine[-1]["served_attention_calls"]
        row["failed_requests"] = sum(r["failed_requests"] for r in mine)
        row["first_error"] = next((r["first_error"] for r in mine if r["first_error"]), None)
        rows.append(row)
    base = rows[0]
    for row in rows:
        if row["decode_tokens_per_s"] and base["decode_tokens_per_s"]:
            row["decode_speedup"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    print(
        f"{args.clients} concurrent streaming clients, prompts {min(lengths)}-{max(lengths)} "
        f"tokens, {args.max_tokens} new tokens each, greedy; model: {CONFIG['num_hidden_layers']}"
        f"-layer Llama, {CONFIG['num_attention_heads']}/{CONFIG['num_key_value_heads']} heads, "
        f"head dim {CONFIG['head_dim']}, float32"
    )
    print_table(
        [{**row, "failed_cell": _failed_cell(row)} for row in rows],
        [
            ("server", "server", "{}"),
            ("ttft_median_s", "TTFT median s", "{:.2f}"),
            ("ttft_max_s", "TTFT max s", "{:.2f}"),
            ("decode_tokens_per_s", "decode tok/s", "{:.1f}"),
            ("steady_tokens_per_s", "steady tok/s", "{:.1f}"),
            ("decode_speedup", "decode vs mlx-lm", "{:.2f}x"),
            ("served_attention_calls", "op calls", "{}"),
            ("failed_cell", "failed (first error)", "{}"),
        ],
    )
    for row in rows:
        if row["first_error"]:
            print(f"{row['server']}: {row['failed_requests']} failed, first: {row['first_error']}")
    path = save(
        args.output or "server",
        {
            "machine": machine(),
            "config": CONFIG,
            "args": vars(args),
            "prompt_lengths": lengths,
            "runs": runs,
            "summary": rows,
            "texts_equal": not mismatched,
        },
    )
    print(f"saved {path}")
    if mismatched:
        print(f"FAILED: requests {mismatched} differ between the servers", file=sys.stderr)
        return 1
    failed = sum(row["failed_requests"] for row in rows)
    if failed:
        print(f"{failed} requests failed (see the table); the answered ones are the same")
    else:
        print(f"OK: all {args.clients} responses are the same with and without the plug-in")
    return 0


if __name__ == "__main__":
    sys.exit(main())
