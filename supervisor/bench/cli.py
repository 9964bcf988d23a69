"""The benchmark's command line and report."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
from tokenizers import Tokenizer

from mlxr.shared.config import Settings
from mlxr.supervisor.bench import peers, scenarios
from mlxr.supervisor.bench import realistic, traffic
from mlxr.supervisor.bench.load import make_prompts, run_load
from mlxr.supervisor.bench.targets import OpenAITarget, RunnerTarget, Sampling
from mlxr.supervisor.bench.targets import greedy_agreement

PRESETS = ("tiny", "small", "medium", "qwen3-0.6b")


def resolve_model(spec: str, cache_dir: Path, dtype: str = "float32") -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if spec in PRESETS:
        from mlxr.supervisor.store.random_model import write_random_model

        dest = cache_dir / (f"random-{spec}" if dtype == "float32" else f"random-{spec}-{dtype}")
        if not (dest / "model.safetensors").exists():
            write_random_model(dest, spec, seed=0, dtype=dtype)
        return dest
    raise SystemExit(f"--model: {spec!r} is neither a model directory nor a preset {PRESETS}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxr bench", description="Serving benchmark")
    p.add_argument("--model", default="small", help="model directory or random preset")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weight type of a random preset")
    p.add_argument("--concurrency", default="1,8,16")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: 2 x concurrency, at least 4)")
    p.add_argument("--sampling", default="greedy", choices=["greedy", "ollama"])
    p.add_argument("--against", default="",
                   help="comma list of peers to run in the same run: mlx_lm, llamacpp")
    p.add_argument("--llama-server", default=os.environ.get("MLXR_LLAMA_SERVER", ""),
                   help="llama.cpp's llama-server binary (default: $MLXR_LLAMA_SERVER, PATH)")
    p.add_argument("--llamacpp-types", default="F32",
                   help="comma list of GGUF types llama-server serves, one server each (F32, Q8_0)")
    p.add_argument("--direct", action="store_true",
                   help="also drive a runner directly, bypassing the supervisor")
    p.add_argument("--scenarios", default="",
                   help="comma list of extra scenarios: prefix, single, stall (or all); "
                        "realistic traffic (issue 19): mixed, chat, long")
    p.add_argument("--scenario-scale", type=float, default=1.0,
                   help="scale the realistic scenarios' token lengths and request counts")
    p.add_argument("--mixed-rate", type=float, default=0.0,
                   help="mixed: arrivals per second (default: measured to keep 16 in flight)")
    p.add_argument("--mlx-bits", type=int, default=0, choices=[0, 4, 8],
                   help="serve an MLX-quantized copy (4 or 8 bits, group 64) to mlxr and "
                        "mlx_lm.server; llama.cpp still gets the float weights as "
                        "--llamacpp-types (e.g. MLX 8-bit against Q8_0)")
    p.add_argument("--output", default="bench-results", help="directory for JSON and PNG")
    return p


def quantized_copy(model_dir: Path, cache: Path, bits: int) -> Path:
    """An MLX-quantized copy of `model_dir` (mlx-lm's own convert), made once per model."""
    import importlib

    dest = cache / "mlx-quantized" / f"{model_dir.name}-{bits}bit"
    if not (dest / "config.json").is_file():
        if dest.exists():
            import shutil

            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        convert = importlib.import_module("mlx_lm.convert").convert
        convert(str(model_dir), mlx_path=str(dest), quantize=True, q_group_size=64,
                q_bits=bits)
    return dest


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    model_dir = resolve_model(args.model, Path.home() / ".cache" / "mlxr-bench", args.dtype)
    # What mlxr and mlx_lm.server serve; llama.cpp's GGUF is always made from model_dir.
    served_dir = quantized_copy(model_dir, Path.home() / ".cache" / "mlxr-bench",
                                args.mlx_bits) if args.mlx_bits else model_dir
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    sampling = Sampling.named(args.sampling)
    against = {a.strip() for a in args.against.split(",") if a.strip()}
    unknown_peers = sorted(against - {"mlx_lm", "llamacpp"})
    if unknown_peers:
        raise SystemExit(f"--against: unknown peers {', '.join(unknown_peers)} (mlx_lm, llamacpp)")
    llama_binary = None
    if "llamacpp" in against:
        try:
            llama_binary = peers.find_llama_server(args.llama_server)
        except peers.PeerNotFound as exc:
            raise SystemExit(str(exc)) from None

    procs: list[peers.Process] = []
    finished = False
    targets = []
    wanted = {n.strip() for n in args.scenarios.split(",")} & set(realistic.NAMES)
    if args.scenario_scale <= 0:
        raise SystemExit("--scenario-scale must be positive")
    # The context our runners serve: the realistic scenarios' 8,000 tokens and more, or a sweep's
    # prompt and reply where they pass the default 4,096 (llama.cpp's slots are sized the same).
    settings = Settings.from_env()  # as `mlxr serve`'s runners
    context = max(realistic.CONTEXT_LENGTH if wanted else 0,
                  args.prompt_tokens + args.gen_tokens + 128)
    context = context if context > settings.context_length else 0
    runner_config = {"context_length": context} if context else {}
    runner_config["kv_layout"] = settings.kv_layout
    runner_config["host_attention"] = settings.host_attention
    runner_config["attention_buckets"] = settings.attention_buckets
    runner_config["float32_weights"] = settings.float32_weights
    if context:  # more than the default 4,096 (our runners only)
        os.environ.setdefault("MLXR_CONTEXT_LENGTH", str(context))
    work = Path(tempfile.mkdtemp(prefix="mlxr-bench-"))
    try:
        parallel = max(levels + [16])
        server = peers.start_supervisor(served_dir, work, parallel)
        procs.append(server)
        targets.append(OpenAITarget("mlxr", server.url, server.extra["model"]))
        blas = server.extra["blas"]
        print(f"blas (read from the mlxr runner, preloaded into every peer): "
              f"{blas['path'] or 'MLX own'} [{blas['config']}]", flush=True)
        if args.direct:
            runner = peers.start_runner(served_dir, work, num_parallel=parallel, **runner_config)
            procs.append(runner)
            targets.append(RunnerTarget("mlxr-runner", runner.url))
        if "mlx_lm" in against:
            peer = peers.start_mlx_lm_server(served_dir, work, blas["path"])
            procs.append(peer)
            targets.append(OpenAITarget("mlx_lm.server", peer.url, peer.extra["model"]))
        if llama_binary is not None:
            targets += start_llamacpp(llama_binary, model_dir, work, parallel, args, tokenizer,
                                      procs)
        peers_served = [t for t in targets[1:] if isinstance(t, OpenAITarget)]
        agreement = asyncio.run(check_greedy(targets[0], peers_served, tokenizer))
        results = asyncio.run(sweep(targets, tokenizer, levels, args, sampling)) if levels else {}
        # Scenarios time single tokens: the runner's protocol reports every token as it is
        # made, where the HTTP APIs only send tokens that have text.
        exact = next((t for t in targets if isinstance(t, RunnerTarget)), targets[0])
        extra = asyncio.run(run_scenarios(args.scenarios, exact, tokenizer, served_dir,
                                          blas["path"]))
        if wanted:
            extra["realistic"] = asyncio.run(realistic.run(
                wanted, realistic.served_targets(targets, procs), tokenizer,
                args.scenario_scale, model_dir, args.mixed_rate))
        extra.update(agreement)
        finished = True
    finally:
        for p in procs:
            p.stop()
        if finished:  # its store holds a copy of the model: hundreds of MB a run
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"the servers' logs are kept in {work}", file=sys.stderr)

    report = {"machine": machine(), "blas": blas, "model": str(model_dir), "args": vars(args),
              "results": results, "scenarios": extra}
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    if results:
        print_table(results, [t.name for t in targets])
        try:
            plot(results, [t.name for t in targets], out_dir / "bench.png")
        except ImportError:
            print("matplotlib is not installed: no plot")
    m = report["machine"]
    print(f"\ncpu: {m['cpu']} (avx512f {'yes' if m['avx512f'] else 'no'}); "
          f"blas: {blas['path'] or 'MLX own'} [{blas['config']}]")
    if "realistic" in extra:
        print("\n" + traffic.report_markdown(extra.pop("realistic")))
    for name, figures in extra.items():
        print(f"\n{name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in figures.items()))
    print(f"\nwrote {out_dir / 'bench.json'}")


def start_llamacpp(binary: Path, model_dir: Path, work: Path, parallel: int, args, tokenizer,
                   procs: list) -> list[OpenAITarget]:
    """One llama-server per GGUF type, on every core, with our writer's GGUF of the model."""
    targets = []
    bias = peers.end_token_bias(tokenizer)
    for file_type in [t.strip() for t in args.llamacpp_types.split(",") if t.strip()]:
        gguf = peers.gguf_model(model_dir, Path.home() / ".cache" / "mlxr-bench" / "gguf",
                                file_type)
        p = peers.start_llama_server(gguf, work, parallel, os.cpu_count() or 1, binary,
                                     ctx_per_slot=args.prompt_tokens + args.gen_tokens + 128,
                                     name=f"llama-server-{file_type}")
        procs.append(p)
        print(f"llama-server {file_type}: {binary} serving {gguf}", flush=True)
        targets.append(OpenAITarget(f"llama.cpp {file_type}", p.url, p.extra["model"],
                                    {"logit_bias": bias}))
    return targets


async def check_greedy(ours: OpenAITarget, others: list[OpenAITarget], tokenizer,
                       count: int = 8, gen_tokens: int = 24) -> dict:
    """Greedy replies of each peer (mlx_lm.server, llama.cpp) against mlxr's, on `count`
    prompts."""
    prompts = make_prompts(tokenizer, count, 32, seed=424242)
    out = {}
    for other in others:
        figures = await greedy_agreement(ours, other, tokenizer, prompts, gen_tokens)
        print(f"greedy {other.name} vs {ours.name}: {figures['identical']}/"
              f"{figures['prompts']} replies identical, {figures['tokens_matched']}/"
              f"{figures['tokens']} tokens", flush=True)
        out[f"greedy_{other.name}"] = figures
    return out


async def sweep(targets, tokenizer, levels, args, sampling) -> dict:
    results: dict[str, dict[str, dict]] = {t.name: {} for t in targets}
    for i, level in enumerate(levels):
        count = args.requests or max(2 * level, 4)
        # Interleave: alternate which server goes first at each level.
        order = targets if i % 2 == 0 else list(reversed(targets))
        for j, target in enumerate(order):
            warm = make_prompts(tokenizer, min(level, 4), args.prompt_tokens, seed=10_000 + i)
            await run_load(target, warm, min(level, 4), 8, sampling)
            prompts = make_prompts(tokenizer, count, args.prompt_tokens, seed=100 * i + j)
            summary = await run_load(target, prompts, level, args.gen_tokens, sampling)
            results[target.name][str(level)] = summary
            print(f"{target.name:>14} c={level:<3} {summary['output_tok_s']:8.1f} tok/s  "
                  f"ttft p99 {summary['ttft_s']['p99'] * 1000:8.1f} ms  "
                  f"itl p50 {summary['itl_s']['p50'] * 1000:6.1f} ms  "
                  f"failed {summary['failed']}", flush=True)
    return results


async def run_scenarios(spec: str, target, tokenizer, model_dir: Path, blas_path: str) -> dict:
    names = {"prefix", "single", "stall"} if spec == "all" else \
        {n.strip() for n in spec.split(",") if n.strip()}
    unknown = names - {"prefix", "single", "stall"} - set(realistic.NAMES)
    if unknown:
        raise SystemExit(f"unknown scenarios: {', '.join(sorted(unknown))}")
    out: dict[str, dict] = {}
    if "prefix" in names:
        out["prefix_cache"] = await scenarios.prefix_cache(target, tokenizer)
    if "single" in names:
        out["single_stream"] = await scenarios.single_stream(target, tokenizer, model_dir,
                                                             blas_path)
    if "stall" in names:
        out["prefill_stall"] = await scenarios.prefill_stall(target, tokenizer)
    return out


def machine() -> dict:
    import mlx.core as mx

    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpu": cpu_model(), "avx512f": has_avx512f(),
            "cpus": psutil.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30),
            "mlx": mx.__version__, "device": str(mx.default_device()),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def cpu_model() -> str:
    """`lscpu`'s model name: every figure is labelled with the CPU it came from."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


def print_table(results: dict, names: list[str]) -> None:
    """Markdown tables: throughput and p99 TTFT, with ours / each other server's ratio."""
    ours, others = names[0], names[1:]
    for title, key, scale, unit in (("output tokens/s", "output_tok_s", 1, ""),
                                    ("TTFT p99", "ttft_s", 1000, " ms")):
        header = f"| concurrency | {ours} |" + "".join(f" {o} | ratio |" for o in others)
        print(f"\n{title}\n{header}\n" + "|---" * (2 + 2 * len(others)) + "|")
        for level, mine in results[ours].items():
            value = mine[key]["p99"] if key == "ttft_s" else mine[key]
            row = f"| {level} | {value * scale:.1f}{unit} |"
            for other in others:
                theirs = results[other][level]
                theirs = theirs[key]["p99"] if key == "ttft_s" else theirs[key]
                row += f" {theirs * scale:.1f}{unit} | {value / theirs:.2f}x |"
            print(row)


def plot(results: dict, names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        levels = sorted(int(k) for k in results[name])
        ax1.plot(levels, [results[name][str(c)]["output_tok_s"] for c in levels], "o-", label=name)
        ax2.plot(levels, [results[name][str(c)]["ttft_s"]["p99"] * 1000 for c in levels], "o-",
                 label=name)
    ax1.set(xlabel="concurrent streams", ylabel="output tokens/s", title="Throughput")
    ax2.set(xlabel="concurrent streams", ylabel="ms", title="TTFT p99")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
