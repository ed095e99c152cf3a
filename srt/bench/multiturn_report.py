"""The tables bench_multiturn prints: TTFT per round, throughput, hit rates per tier, the
ratios the hierarchical cache is judged by, and the outputs check."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixlm.srt.bench.bench_multiturn import ModeRun, Workload

TIER_COUNTERS = (
    "queried_tokens",
    "device_hit_tokens",
    "host_hit_tokens",
    "disk_hit_tokens",
    "load_back_tokens",
    "write_back_tokens",
    "loads_skipped_slower",
    "loads_skipped_no_memory",
)
FROM_ROUND = 3  # steady-state figures use rounds 3 and later (1-based)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def print_rounds(runs: list[ModeRun], num_rounds: int) -> None:
    print("\nmean TTFT (s) per round; rounds are 1-based")
    print(f"{'round':<8}" + "".join(f"{r.mode:>10}" for r in runs))
    for i in range(num_rounds):
        print(f"{i + 1:<8}" + "".join(f"{fmt(r.ttft({i}), '.3f'):>10}" for r in runs))
    print(f"{f'>= {FROM_ROUND}':<8}" + "".join(f"{fmt(r.ttft_steady(), '.3f'):>10}" for r in runs))
    print(f"{'all':<8}" + "".join(f"{fmt(r.ttft(), '.3f'):>10}" for r in runs))


def print_throughput(runs: list[ModeRun]) -> None:
    print(f"\n{'mode':<9}{'req/s':>8}{'out tok/s':>11}{'wall s':>9}{'TTFT s':>9}{'TTFT >= 3':>11}")
    for r in runs:
        wall = r.wall_s or float("nan")
        out_tokens = sum(q.completion_tokens for q in r.reqs)
        print(
            f"{r.mode:<9}{fmt(len(r.reqs) / wall, '.3f'):>8}{fmt(out_tokens / wall, '.2f'):>11}"
            f"{fmt(r.wall_s, '.1f'):>9}{fmt(r.ttft(), '.3f'):>9}{fmt(r.ttft_steady(), '.3f'):>11}"
        )


def print_hits(runs: list[ModeRun], workload: Workload, page_size: int) -> None:
    print(
        "\nhit rates. cached: sum(cached) / sum(prompt tokens) of the requests; best: an unbounded"
        "\ncache (restart: every full page of every prompt, all on disk). server: the tier"
        "\ncounters' hit tokens / queried tokens (counted at every admission attempt; q/prompt:"
        "\nqueried / prompt tokens). loaded: host -> device tokens (/prompt: over prompt tokens);"
        "\nwritten: device -> host tokens; loads skipped as slower than recompute, or for no room."
    )
    print(
        f"{'':<9}{'':>7}{'':>7}{'server (of queried)':^22}{'':>9}{'loaded':^15}{'written':>8}"
        f"{'loads skipped':>15}"
    )
    print(
        f"{'mode':<9}{'cached':>7}{'best':>7}{'device':>8}{'host':>7}{'disk':>7}{'q/prompt':>9}"
        f"{'tokens':>8}{'/prompt':>8}{'tokens':>8}{'slower':>8}{'memory':>7}"
    )
    for r in runs:
        t = r.tiers or {}
        best = best_hit_rate(workload, page_size, replay=r.mode == "restart")
        server = r.queried_split()
        prompt = sum(q.prompt_tokens for q in r.reqs) or float("nan")
        per_prompt = {k: t[k] / prompt if k in t else None for k in TIER_COUNTERS}
        print(
            f"{r.mode:<9}{fmt(r.hit_rate, '.1%'):>7}{best:>7.1%}{fmt(server['device'], '.1%'):>8}"
            f"{fmt(server['host'], '.1%'):>7}{fmt(server['disk'], '.1%'):>7}"
            f"{fmt(per_prompt['queried_tokens'], '.2f'):>9}"
            f"{fmt(t.get('load_back_tokens'), 'd'):>8}"
            f"{fmt(per_prompt['load_back_tokens'], '.2f'):>8}"
            f"{fmt(t.get('write_back_tokens'), 'd'):>8}"
            f"{fmt(t.get('loads_skipped_slower'), 'd'):>8}"
            f"{fmt(t.get('loads_skipped_no_memory'), 'd'):>7}"
        )
    for r in runs:
        if r.disk:
            print(f"{r.mode} disk tier at the end: {disk_line(r.disk)}")
    for r in runs:
        if r.phases:
            shown = ", ".join(f"{k} {v:.2f}" for k, v in r.phases.items())
            print(f"{r.mode} tier phases (s, and measured us per token): {shown}")


def disk_line(d: dict) -> str:
    mb = lambda k: f"{d.get(k, 0) / 1e6:.1f} MB"  # noqa: E731
    rate = d.get("disk_bytes_per_s")
    return (
        f"{d.get('disk_pages', 0)} pages, {mb('disk_used_bytes')} used, "
        f"{mb('disk_bytes_written')} written, {mb('disk_bytes_read')} read, "
        f"{d.get('disk_evicted_pages', 0)} pages evicted, measured read rate "
        + (f"{rate / 1e9:.2f} GB/s" if rate else "-")
        + f"; disk-hit path {d.get('path_bytes_per_s', 0) / 1e9:.2f} GB/s vs a raw read of "
        f"the folder {d.get('raw_read_bytes_per_s', 0) / 1e9:.2f} GB/s"
    )


def ratio_line(name: str, num: float, den: float, target: float | None, unit: str = "x") -> str:
    if not (den and num == num and den == den):
        return f"{name}: -"
    value = num / den
    shown = f"{value:.1%}" if unit == "%" else f"{value:.2f}x"
    if target is None:
        return f"{name}: {shown}"
    goal = f"{target:.0%}" if unit == "%" else f"{target:g}x"
    return f"{name}: {shown} (target >= {goal}: {'met' if value >= target else 'NOT met'})"


def print_ratios(runs: list[ModeRun], workload: Workload, page_size: int) -> None:
    by = {r.mode: r for r in runs if r.error is None and r.reqs}
    recompute = by.get("device") or by.get("off")
    ttft = {m: r.ttft_steady() for m, r in by.items()}
    hit = {m: r.hit_rate for m, r in by.items()}
    checks = [  # name, numerator, denominator, target, unit
        ("device-only TTFT / host TTFT", ttft.get("device"), ttft.get("host"), 2.0, "x"),
        (
            f"recompute ({recompute.mode if recompute else '-'}) TTFT / disk TTFT",
            recompute and recompute.ttft_steady(),
            ttft.get("disk"),
            None,
            "x",
        ),
        ("restart hit rate / disk hit rate", hit.get("restart"), hit.get("disk"), 0.9, "%"),
        (
            "restart hit rate / its best (a replay: every full page of every prompt on disk)",
            hit.get("restart"),
            best_hit_rate(workload, page_size, replay=True),
            None,
            "%",
        ),
    ]
    print(f"\nratios (TTFT from round {FROM_ROUND} on)")
    for name, num, den, target, unit in checks:
        if num is not None and den is not None:
            print(ratio_line(name, num, den, target, unit))


NEAR_TIE = 0.05  # nats: a top-1 / top-2 logprob gap this small is flipped by rounding alone


def divergences(ref: ModeRun, run: ModeRun) -> list[float]:
    """For each output of ``run`` that differs from ``ref``'s: the top-1 minus top-2 logprob
    gap where they first differ (the smaller of the two runs' gaps; inf if unknown)."""
    gaps = []
    for key, ids in run.outputs.items():
        want = ref.outputs.get(key)
        if want is None or want == ids:
            continue
        i = next((j for j, (a, b) in enumerate(zip(want, ids, strict=False)) if a != b), None)
        if i is None:  # one is a prefix of the other
            gaps.append(float("inf"))
            continue
        pair = [g[i] for g in (ref.gaps.get(key, []), run.gaps.get(key, [])) if i < len(g)]
        gaps.append(min(pair, default=float("inf")))
    return gaps


def print_outputs_check(runs: list[ModeRun]) -> None:
    """How many outputs each mode shares with the reference: ``off`` (no prefix cache) when it
    ran, else the first mode. Greedy outputs are all the same if every tier gives back the KV it
    was given, up to rounding: a prefix's KV computed under other prefill splits (another cached
    length, another chunk) rounds differently, which in bf16 flips near-ties. So each differing
    output is located at its first differing token and judged by the top-2 logprob gap there: a
    near-tie (< ``NEAR_TIE`` nats) is numerics; a wider gap points at wrong KV."""
    done = [r for r in runs if r.outputs]
    if len(done) < 2:
        return
    ref = next((r for r in done if r.mode == "off"), done[0])
    parts, notes = [], []
    for r in done:
        if r is ref:
            continue
        gaps = divergences(ref, r)
        parts.append(f"{r.mode} {len(r.outputs) - len(gaps)}/{len(r.outputs)}")
        if not gaps:
            continue
        ties = [g for g in gaps if g < NEAR_TIE]
        wide = [g for g in gaps if g >= NEAR_TIE]
        if ties:
            notes.append(
                f"  {r.mode}: {len(ties)} differ first at a near-tie (top-2 logprob gap at most "
                f"{max(ties):.4f} nats < {NEAR_TIE}): rounding, not a wrong page"
            )
        if wide:
            notes.append(
                f"  {r.mode}: {len(wide)} differ first where the top-2 gap was >= {NEAR_TIE} nats "
                f"({_counts(wide)}): not a near-tie; check the tier's KV (float32: "
                "tests/srt/scheduler/test_hicache_staged_restart.py, on the CPU and on a GPU)"
            )
        notes.append(_computed_split(ref, r))
    what = "no prefix cache" if ref.mode == "off" else "itself cached under its own splits"
    print(f"outputs identical to {ref.mode}'s ({what}): " + ", ".join(parts))
    all_gaps = sorted(g for gs in ref.gaps.values() for g in gs if g != float("inf"))
    if notes and all_gaps:
        notes.append(
            f"  (median top-2 gap over {ref.mode}'s tokens: {all_gaps[len(all_gaps) // 2]:.4f})"
        )
    for line in notes:
        print(line)


def _counts(gaps: list[float]) -> str:
    """``0.0625 x8, 0.125 x2``: bf16 logits step by 2^-4 between 8 and 16, so one step there is
    above ``NEAR_TIE`` and still only rounding."""
    values = sorted(set(gaps))
    return ", ".join(f"{g:.4f} x{gaps.count(g)}" for g in values[:6]) + (
        ", ..." if len(values) > 6 else ""
    )


def _computed_split(ref: ModeRun, run: ModeRun) -> str:
    """The median prompt tokens a request computed (not cached) in ``run``, for its outputs that
    differ from ``ref``'s and for those that do not: rounding follows the prefill's shape (a
    prompt computed as one short tail over a long cached prefix runs other GEMM shapes than the
    whole prompt), a wrong page does not."""
    computed = {(q.conversation, q.round): q.prompt_tokens - q.cached_tokens for q in run.reqs}
    split: dict[bool, list[int]] = {True: [], False: []}
    for key, ids in run.outputs.items():
        if key in computed and key in ref.outputs:
            split[ref.outputs[key] != ids].append(computed[key])
    median = lambda v: "-" if not v else str(sorted(v)[len(v) // 2])  # noqa: E731
    return (
        f"  {run.mode}: prompt tokens computed per request (median): {median(split[True])} where "
        f"the output differs, {median(split[False])} where it does not"
    )


def best_hit_rate(workload: Workload, page_size: int, replay: bool = False) -> float:
    """The hit rate of an unbounded cache of whole pages: each round reuses the history's KV
    (the last generated token has none yet). ``replay``: the same prompts were all cached
    before (a restart over a full disk tier): every full page of each prompt but its last token."""
    pages = lambda n: max(0, n) // page_size * page_size  # noqa: E731 - whole pages
    hits = total = 0
    for turns in workload.turns:
        history = 0
        for t in turns:
            prompt = history + len(t)
            hits += pages(prompt - 1) if replay else pages(history - 1)
            total += prompt
            history = prompt + workload.output_len
    return hits / total
