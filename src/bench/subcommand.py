"""``headrace bench``: run workloads in every mode against a daemon and write the results."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from headrace.bench.agents import AGENT_MODES, AGENTS, DEFAULT_AGENT_MODES, RESPONSES_MODE, SHAPES, VLLM_MODE
from headrace.bench.mixed import MIXED_BENCH
from headrace.bench.mixed import SHAPES as MIX_SHAPES
from headrace.bench.quality import QUALITY
from headrace.bench.quality import add_arguments as add_quality_arguments
from headrace.bench.rag_qa import RAG_QA
from headrace.bench.rag_qa import add_arguments as add_rag_qa_arguments
from headrace.bench.rag_repeat import RAG_REPEAT
from headrace.bench.rag_repeat import add_arguments as add_rag_repeat_arguments
from headrace.bench.soak import SOAK
from headrace.bench.workloads import MIXED_MODES, WORKLOADS
from headrace.daemon.config import default_config_path

DEFAULT_OUT = Path("bench-results")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmark workloads: headrace vs its baselines, ratios from one run",
                       description="Run each workload in each mode against one daemon (a running one with --url, "
                                   "or one started here with --config) and write results.json, results.txt and "
                                   "PNG plots to --out.")
    p.add_argument("workloads", nargs="+", metavar="WORKLOAD",
                   help=f"one or more of {', '.join(WORKLOADS)}, {AGENTS} (the agents benchmark: --agents-...), "
                        f"{MIXED_BENCH} (one stream of chats, workflows and agents: --mixed-...), {SOAK} (mixed "
                        "traffic at a steady load for an hour, the daemon's RSS and descriptors sampled: --soak-...; "
                        f"runs alone), {RAG_REPEAT} (RAG over a collection whose popular chunks recur, a daemon per "
                        "KV-cache mode and llama-server: --rag-...; runs alone), "
                        f"{QUALITY} (every LLM engine, quantization and KV path against a float32 reference on the "
                        "same weights, speed beside quality, engines in this process: --quality-...; runs alone), "
                        f"{RAG_QA} (what a RAG prompt's layout costs in answers: extractive questions scored by "
                        "exact match and token F1, the engine in this process: --qa-...; runs alone)")
    p.add_argument("--modes", nargs="+", help="modes for the single-query phase (default: the workload's baseline, "
                   "sequential, headrace); server modes: sequential, +<pass>..., headrace, headrace-fifo, "
                   "headrace-topology, headrace-objective, headrace-deadline, headrace-las (headrace under that LLM "
                   "policy); baselines: llamaindex (RAG), chaining (summaries), client (debate, agent: the loop as an "
                   "openai-SDK client)")
    p.add_argument("--ladder", nargs="*", metavar="WORKLOAD",
                   help="single query: also switch each pass on in turn (for the named workloads; none named: all)")
    p.add_argument("--reps", type=int, default=3, help="measured repetitions per mode (default 3; 0 skips the phase)")
    p.add_argument("--rates", type=float, nargs="*", default=[], help="Poisson load rates in req/s (default: none)")
    p.add_argument("--load-fractions", type=float, nargs="*", default=[],
                   help="load rates as fractions of the measured capacity (one over the baseline's single-query "
                        "latency), e.g. 0.5 0.8 1 1.2")
    p.add_argument("--arrivals", type=int, help="Poisson arrivals per load point (the window ends at the last; "
                                                "default: as many as --duration draws)")
    p.add_argument("--load-modes", nargs="+", help="modes for the load phase (default: the baseline and headrace)")
    p.add_argument("--load-workloads", nargs="+", metavar="WORKLOAD",
                   help="the workloads that get the load phase (default: all of them, when --rates is given)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per load point (default 60)")
    p.add_argument("--drain", type=float, help="seconds to wait for stragglers after arrivals (default 2 x SLO)")
    p.add_argument("--mixed-rate", type=float,
                   help="req/s of the SLO-based mixed load (advanced_rag + map_reduce_summary; not the mixed "
                        "benchmark)")
    p.add_argument("--mixed-chat", action="store_true",
                   help="the --mixed-rate load carries plain chats on a shared system prompt too (a third of the "
                        "arrivals)")
    p.add_argument("--mixed-rate-modes", dest="mixed_rate_modes", nargs="+", default=list(MIXED_MODES), metavar="MODE",
                   help=f"the headrace modes the --mixed-rate load runs after its baselines (default "
                        f"{' '.join(MIXED_MODES)}; e.g. headrace-deadline, whose runs state their SLO)")
    p.add_argument("--chat", type=int, default=0, metavar="N",
                   help="chat phase: N chats on a shared system prompt, time to first token with prefix caching "
                        "off, then on (default 0: none)")
    p.add_argument("--system-tokens", type=int, default=1000, help="the chats' shared system prompt (default 1000)")
    p.add_argument("--max-tokens", type=int, help="override every workload's output length")
    p.add_argument("--agents-size", choices=list(SHAPES), default="full",
                   help="the agents benchmark's sizes: full (1,000-token system prompt, 2-12 turns, tools 0.2-3 s) or "
                        "smoke (a short prompt, 2-3 turns, quick tools)")
    p.add_argument("--agents-fractions", type=float, nargs="*",
                   help="agents load points as fractions of the capacity a closed-loop probe measures "
                        "(default 0.5 0.7 0.9 unless --agents-rates)")
    p.add_argument("--agents-rates", type=float, nargs="*", default=[], help="agents load points in agents/s")
    p.add_argument("--agents-programs", type=int, default=60, help="Poisson agent arrivals per point (default 60)")
    p.add_argument("--agents-modes", nargs="+", default=list(DEFAULT_AGENT_MODES), metavar="MODE",
                   help=f"modes of the agents benchmark, from {', '.join(AGENT_MODES)} (settings of the one daemon), "
                        f"{RESPONSES_MODE} (program-aware's settings, the agents on POST /v1/responses with "
                        f"previous_response_id) and {VLLM_MODE} (the same agents against a second daemon started per point from .venv-vllm "
                        "with --agents-vllm-config: the vllm engine plugin with vLLM's own prefix caching; "
                        f"scripts/setup-vllm builds the venv) (default {' '.join(DEFAULT_AGENT_MODES)})")
    p.add_argument("--agents-vllm-venv", type=Path, metavar="DIR",
                   help=f"the venv the {VLLM_MODE} mode's daemon runs from (default: $HEADRACE_VLLM_VENV, else the "
                        "repository's .venv-vllm)")
    p.add_argument("--agents-vllm-config", type=Path, metavar="TOML",
                   help=f"the {VLLM_MODE} mode's daemon config (default: the repository's configs/vllm-cpu.toml)")
    p.add_argument("--agents-vllm-url", metavar="URL",
                   help=f"the {VLLM_MODE} mode against this running daemon (headrace serve on the vllm engine plugin) "
                        "rather than one started per point: nothing is started or closed, and its prefix cache "
                        "starts with whatever it served before")
    p.add_argument("--agents-vllm-api-key", default="", metavar="KEY", help="the --agents-vllm-url daemon's API key")
    p.add_argument("--agents-probe", type=int, metavar="N",
                   help="agents at once in the capacity probe (default: the size's, 8 for full)")
    p.add_argument("--mixed-size", choices=list(MIX_SHAPES), default="full",
                   help="the mixed benchmark's sizes: full (40%% chats, 25%% naive_rag, 15%% map_reduce_summary, 10%% "
                        "traced agent runs, 10%% client agents of the agents benchmark's full size) or smoke (one of "
                        "each per five arrivals, each as small as it goes)")
    p.add_argument("--mixed-fractions", type=float, nargs="*",
                   help="mixed load points as fractions of the capacity a closed-loop probe measures "
                        "(default 0.7 0.9 unless --mixed-rates)")
    p.add_argument("--mixed-rates", type=float, nargs="*", default=[], help="mixed load points in programs/s")
    p.add_argument("--mixed-programs", type=int, default=60, help="Poisson program arrivals per point (default 60)")
    p.add_argument("--mixed-modes", nargs="+", metavar="MODE",
                   help=f"modes of the mixed benchmark, from {', '.join(AGENT_MODES)} "
                        f"(default {' '.join(DEFAULT_AGENT_MODES)})")
    p.add_argument("--mixed-probe", type=int, metavar="N",
                   help="programs at once in the mixed capacity probe (default: the size's, 8 for full)")
    p.add_argument("--agents-background", type=float, default=0.0, metavar="RATE",
                   help="unrelated chats per second beside the agents, each its own prefix with a short answer, "
                        "reported apart (default 0: none)")
    p.add_argument("--agents-background-tokens", type=int, metavar="N",
                   help="a background chat's prompt, about (default: the size's, 500 for full)")
    p.add_argument("--agents-chats", type=float, default=0.0, metavar="RATE",
                   help="one-call probe chats per second beside the agents: their time to first token against an "
                        "idle engine's, measured before each point (default 0: none)")
    p.add_argument("--agents-cache-tokens", type=int, metavar="N",
                   help="a memory-pressure point: the LLM's prefix cache budget in tokens for the whole agents "
                        "benchmark, every mode and the probe (PATCH /v1/engines, the daemon's own put back after); "
                        "the report sets it beside the live agents' contexts measured. Try about half the live set "
                        "(2048 for full at 0.7; default: the daemon's own)")
    p.add_argument("--agents-pin-tokens", type=int, metavar="N",
                   help="with --agents-cache-tokens: what pins may hold of it (default: the configured share, a "
                        "quarter in configs/default.toml; a full agent's context is 1,000-2,000 tokens)")
    p.add_argument("--soak-seconds", type=float, default=3600.0,
                   help="the soak's window of arrivals in seconds (default 3600; a few minutes for a smoke)")
    p.add_argument("--soak-fraction", type=float, default=0.8,
                   help="the soak's rate as a fraction of the capacity its closed-loop probe measures (default 0.8)")
    p.add_argument("--soak-rate", type=float, help="the soak's rate in arrivals/s (no probe)")
    p.add_argument("--soak-sample-seconds", type=float, default=30.0,
                   help="seconds between samples of the daemon's RSS and open descriptors (default 30)")
    p.add_argument("--soak-pid", type=int,
                   help="the daemon's process id, with --url (default: the process listening on its port here)")
    p.add_argument("--soak-probe", type=int, default=4, metavar="N",
                   help="arrivals at once in the soak's capacity probe (default 4; three times as many in all)")
    add_rag_repeat_arguments(p)
    add_quality_arguments(p)
    add_rag_qa_arguments(p)
    p.add_argument("--documents", type=int, default=4, help="corpus documents (default 4)")
    p.add_argument("--doc-tokens", type=int, default=2000, help="minimum tokens per document (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the unmeasured warm-up run of each mode (a smoke run: the first repetition then "
                        "pays the cold start)")
    p.add_argument("--url", help="a running daemon's base URL (default: start one with --config)")
    p.add_argument("--api-key", default=os.environ.get("HEADRACE_API_KEY", ""), help="its API key")
    p.add_argument("--config", type=Path,
                   default=default_config_path(),
                   help="the daemon's TOML config (default: $HEADRACE_CONFIG, else the packaged CPU default): "
                        "started with it unless --url; its LLM's tokenizer is the baselines'")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory (default bench-results/)")


def run(args: argparse.Namespace) -> int:
    import anyio

    from headrace.bench import report
    from headrace.bench.baselines import MissingPeer
    from headrace.bench.client import BenchError, Daemon, DaemonProcess
    from headrace.bench.corpus import build_corpus
    from headrace.bench.cpu import CPUWatch
    from headrace.bench.harness import Options, Systems, run_all
    from headrace.bench.soak import soak_phase
    from headrace.bench.soak_report import daemon_pid

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    unknown = [w for w in [*args.workloads, *(args.ladder or ()), *(args.load_workloads or ())]
               if w not in WORKLOADS and w not in (AGENTS, MIXED_BENCH, SOAK, RAG_REPEAT, QUALITY, RAG_QA)]
    if unknown:
        print(f"headrace bench: unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}, {AGENTS}, "
              f"{MIXED_BENCH}, {SOAK}, {RAG_REPEAT}, {QUALITY}, {RAG_QA}", file=sys.stderr)
        return 2
    if QUALITY in args.workloads:  # its engines in this process, its own result files
        from headrace.bench.quality import run_command as run_quality

        return run_quality(args)
    if RAG_QA in args.workloads:  # its engine in this process, its own result files
        from headrace.bench.rag_qa import run_command as run_rag_qa

        return run_rag_qa(args)
    if RAG_REPEAT in args.workloads:  # its own daemons, one per mode, and its own result files
        from headrace.bench.rag_repeat import run_command

        return run_command(args, llm_tokenizer(args.config))
    agents = agents_options(args) if AGENTS in args.workloads else None
    mixed = mixed_options(args) if MIXED_BENCH in args.workloads else stray_mixed_flags(args)
    soak = soak_options(args) if SOAK in args.workloads else stray_soak_flags(args)
    for problem in (agents, mixed, soak):
        if isinstance(problem, str):
            print(f"headrace bench: {problem}", file=sys.stderr)
            return 2
    workloads = [w for w in args.workloads if w not in (AGENTS, MIXED_BENCH, SOAK)]
    t0 = time.perf_counter()
    process = None
    try:
        tokenizer = llm_tokenizer(args.config)
        corpus = build_corpus(args.seed, n_documents=args.documents, min_tokens=args.doc_tokens,
                              count_tokens=lambda text: len(tokenizer(text)))
        if args.url:
            base_url, api_key = args.url, args.api_key
        else:
            print(f"starting a daemon with {args.config} ...", flush=True)
            process = DaemonProcess(args.config).wait_ready()
            base_url, api_key = process.base_url, process.api_key
        if soak is not None:  # the process whose RSS and descriptors it samples
            soak.pid = process.proc.pid if process else soak.pid or daemon_pid(base_url)
        ladder = set() if args.ladder is None else set(args.ladder or workloads)
        opts = Options(workloads=workloads, modes=args.modes, ladder=ladder, reps=args.reps, warmup=args.warmup,
                       rates=args.rates, load_fractions=args.load_fractions, arrivals=args.arrivals,
                       load_modes=args.load_modes, chat=args.chat, mixed_chat=args.mixed_chat,
                       mixed_modes=args.mixed_rate_modes,
                       system_tokens=args.system_tokens,
                       load_workloads=set(args.load_workloads or workloads), duration=args.duration, drain=args.drain,
                       mixed_rate=args.mixed_rate, seed=args.seed, max_tokens=args.max_tokens, agents=agents,
                       mixed_programs=mixed,
                       log=lambda line: print(line, flush=True))
        cpu = CPUWatch(pids=[soak.pid] if soak is not None else [process.proc.pid] if process else ())

        async def main() -> dict[str, Any]:
            daemon = Daemon(base_url, api_key)
            try:
                if soak is not None:
                    return {"soak": await soak_phase(Systems(daemon, tokenizer), corpus, soak, opts.log)}
                return await run_all(Systems(daemon, tokenizer), corpus, opts)
            finally:
                await daemon.aclose()

        results = anyio.run(main)
        cpu_other = cpu.cores()["other_processes"]  # while the daemon process still exists
    except (MissingPeer, BenchError) as exc:
        print(f"headrace bench: {exc}", file=sys.stderr)
        return 2
    finally:
        if process is not None:
            process.close()
    results["corpus"] = corpus.to_json()
    results["meta"] = {"machine": machine(), "cpu_other": cpu_other,
                       "elapsed_s": time.perf_counter() - t0, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "argv": sys.argv[1:]}
    files = report.write(results, args.out)
    print(report.text_report(results))
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 1 if soak is not None and not results["soak"]["criteria"]["passed"] else 0  # a failed soak says so


def agents_options(args: argparse.Namespace) -> Any:
    """The agents benchmark's options from the flags, or what is wrong with them."""
    from headrace.bench.agents import AgentsOptions
    from headrace.bench.agents_vllm import check_vllm
    from headrace.bench.client import BenchError

    fractions = args.agents_fractions
    if fractions is None:
        fractions = [] if args.agents_rates else [0.5, 0.7, 0.9]
    opts = AgentsOptions(shape=SHAPES[args.agents_size], fractions=fractions, rates=args.agents_rates,
                         programs=args.agents_programs, modes=args.agents_modes, probe_agents=args.agents_probe,
                         drain_s=300.0 if args.drain is None else args.drain, seed=args.seed,
                         background=args.agents_background, background_tokens=args.agents_background_tokens,
                         chats=args.agents_chats, cache_tokens=args.agents_cache_tokens,
                         pin_tokens=args.agents_pin_tokens, vllm_venv=args.agents_vllm_venv,
                         vllm_config=args.agents_vllm_config, vllm_url=args.agents_vllm_url,
                         vllm_api_key=args.agents_vllm_api_key)
    try:
        opts.check()
    except ValueError as exc:
        return str(exc)
    if not opts.fractions and not opts.rates:
        return "the agents benchmark needs --agents-fractions or --agents-rates"
    try:
        check_vllm(opts)  # before the daemon starts
    except BenchError as exc:
        return str(exc)
    return opts


def stray_mixed_flags(args: argparse.Namespace) -> str | None:
    """The mixed benchmark's flags given without it (``--mixed-rates`` is one letter from the older load's
    ``--mixed-rate``): said, rather than silently ignored."""
    flags = {"--mixed-fractions": args.mixed_fractions is not None, "--mixed-rates": args.mixed_rates,
             "--mixed-programs": args.mixed_programs != 60, "--mixed-modes": args.mixed_modes,
             "--mixed-probe": args.mixed_probe, "--mixed-size": args.mixed_size != "full"}
    given = [flag for flag, value in flags.items() if value]
    if not given:
        return None
    return (f"{', '.join(given)} belong to the mixed benchmark: add {MIXED_BENCH} to the workloads (the SLO-based "
            "mixed load is --mixed-rate, --mixed-chat, --mixed-rate-modes)")


def stray_soak_flags(args: argparse.Namespace) -> str | None:
    """The soak's flags given without it: said, rather than silently ignored."""
    flags = {"--soak-seconds": args.soak_seconds != 3600.0, "--soak-fraction": args.soak_fraction != 0.8,
             "--soak-rate": args.soak_rate is not None, "--soak-sample-seconds": args.soak_sample_seconds != 30.0,
             "--soak-pid": args.soak_pid is not None, "--soak-probe": args.soak_probe != 4}
    given = [flag for flag, value in flags.items() if value]
    return f"{', '.join(given)} belong to the soak: add {SOAK} to the workloads" if given else None


def soak_options(args: argparse.Namespace) -> Any:
    """The soak's options from the flags, or what is wrong with them."""
    from headrace.bench.soak import SoakOptions

    others = [w for w in args.workloads if w != SOAK]
    if others:
        return f"the soak runs alone (its daemon's RSS and descriptors are the measurement): drop {' '.join(others)}"
    if args.soak_pid is not None and not args.url:
        return "--soak-pid goes with --url: a daemon started here is sampled by its own pid"
    opts = SoakOptions(seconds=args.soak_seconds, fraction=args.soak_fraction, rate=args.soak_rate,
                       sample_s=args.soak_sample_seconds, pid=args.soak_pid, probe_concurrency=args.soak_probe,
                       drain_s=300.0 if args.drain is None else args.drain, max_tokens=args.max_tokens, seed=args.seed)
    try:
        opts.check()
    except ValueError as exc:
        return str(exc)
    return opts


def mixed_options(args: argparse.Namespace) -> Any:
    """The mixed benchmark's options from the flags, or what is wrong with them."""
    from headrace.bench.mixed import MixedOptions

    fractions = args.mixed_fractions
    if fractions is None:
        fractions = [] if args.mixed_rates else [0.7, 0.9]
    opts = MixedOptions(shape=MIX_SHAPES[args.mixed_size], fractions=fractions, rates=args.mixed_rates,
                        programs=args.mixed_programs, modes=args.mixed_modes or list(DEFAULT_AGENT_MODES),
                        probe_concurrency=args.mixed_probe,
                        drain_s=300.0 if args.drain is None else args.drain, seed=args.seed)
    try:
        opts.check()
    except ValueError as exc:
        return str(exc)
    if not opts.fractions and not opts.rates:
        return "the mixed benchmark needs --mixed-fractions or --mixed-rates"
    return opts


def machine() -> str:
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def llm_tokenizer(config_path: Path) -> Callable[[str], list]:
    """The config's first built-in LLM's tokenizer (torch or llama-cpp: both read the model's own from its GGUF),
    so the corpus's token sizes and the baselines' prompt-token counts are the daemon's tokens whatever engine
    serves it. With neither, words (a rough count, said so)."""
    from headrace.daemon.config import load_config
    from headrace.plugins.engines.llama_cpp.options import DEFAULT_MODEL
    from headrace.plugins.engines.llama_cpp.files import load_tokenizer
    from headrace.plugins.engines.models.paths import resolve_model

    config = load_config(config_path)
    llm = next((e for e in config.engines if e.plugin in ("torch", "llama-cpp")), None)
    if llm is None:
        print(f"headrace bench: {config_path} serves no torch or llama-cpp LLM; document sizes are counted in words",
              file=sys.stderr)
        return lambda text: text.split()
    path = resolve_model(llm.model or DEFAULT_MODEL)
    if path.suffix == ".gguf":
        tokenizer = load_tokenizer(path, config.data.cache_path())
    else:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return lambda text: tokenizer.encode(text, add_special_tokens=False)
