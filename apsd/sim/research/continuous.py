"""The same policies on a continuous engine, and which conclusions change: load, utilisation and
cost, starvation, the governor and fairness while overloaded (a section of research.md)."""

from __future__ import annotations

import math

from apsd.core.config import Config, parse_section
from apsd.engines import describe
from apsd.policies.aging import ApsParams
from apsd.sim.report import RunSummary, describe_engine
from apsd.sim.research.claims import (
    CLAIMED_COST_PER_1M_TOKENS_USD,
    CLAIMED_GPU_UTILIZATION,
    JAIN_TIE,
    LIGHT_LOAD,
    MATERIAL_CHANGE,
    WINDOW_MATCH_MS,
    WINDOW_ROUNDING_MS,
    percent,
)
from apsd.sim.research.measured import Measured, known
from apsd.sim.research.prose import change, jain_cell, listing, names, pct, pct_cell, sec_cell, seconds, usd
from apsd.sim.research.suite import (
    BATCH,
    CONTINUOUS,
    ENGINES,
    GOVERNOR_WORKLOADS,
    SCALED,
    WORKLOADS,
    continuous_names,
    report_dir,
)

__all__ = ["continuous_section"]


def _cont(m: Measured, name: str, label: str = "aps") -> RunSummary:
    return m.run(CONTINUOUS, name, label)


def _load(m: Measured, name: str, label: str = "aps") -> float | None:
    """Throughput of a run on the continuous engine as a fraction of a full engine's."""
    full = m.full_engine_tps[name]
    tps = _cont(m, name, label).overall.throughput_tokens_per_s
    return None if not full or tps is None else tps / full


def _decode_step_ms(m: Measured) -> tuple[float, float]:
    """A decode step at 512 tokens of context: of one sequence, and of ``max_sequences``, in ms."""
    d, e = m.deployment, m.configs[CONTINUOUS].engine
    return d.step_s((), 1, 512) * 1000, d.step_s((), e.max_sequences, e.max_sequences * 512) * 1000


def _peak_throughput(m: Measured, engine: str) -> float:
    return max(s.overall.throughput_tokens_per_s or 0.0 for runs in m.results[engine].values() for s in runs)


def _engine_words(m: Measured, engine: str) -> str:
    return describe_engine(describe(m.configs[engine]).as_dict())


def _intro(m: Measured, config: Config) -> str:
    d, e = m.deployment, m.configs[CONTINUOUS].engine
    one, full = _decode_step_ms(m)
    scaled = "; ".join(s.described() for s in SCALED)
    return "\n".join([
        f"The same policies and workloads on {_engine_words(m, CONTINUOUS)}: `[engine] kind = "
        f"\"continuous\"`, `gpu = \"{e.gpu}\"`, `model = \"{e.model}\"`, the roofline model of "
        "[docs/explanation/engines.md](explanation/engines.md). It batches at the iteration level: a dispatched request joins the "
        "running batch at the next step, and a step takes milliseconds, not seconds (one sequence decoding "
        f"at 512 tokens of context: {one:.1f} ms; {e.max_sequences} of them: {full:.1f} ms). Its KV cache "
        f"holds {d.kv_capacity_tokens:,} tokens; at most {e.max_sequences} sequences run at once and a step "
        f"carries at most {e.max_batched_tokens:,} tokens. It costs ${d.price_per_hour_usd:.2f} per hour of "
        f"busy time, the `{e.gpu}` profile's price (the batch engine charges "
        f"${config.gpu.price_per_hour_usd:.2f}). Reports: `research/continuous/<workload>/`.",
        "",
        "The design's workloads were sized for the batch engine's GPU: the most it served in these runs is "
        f"{_peak_throughput(m, BATCH):,.0f} output tokens/s, against {_peak_throughput(m, CONTINUOUS):,.0f} "
        "for this engine. To see contention on it, two scaled variants of the overload scenarios run on it too "
        f"(not on the batch engine; the built-in defaults are unchanged): {scaled}.",
    ])


def _load_table(m: Measured) -> str:
    batch = m.results[BATCH]
    lines = []
    for name in continuous_names():
        s = _cont(m, name)
        o, e = s.overall, s.engine
        bo = batch[name]["aps"].overall if name in batch else None
        lines.append(
            f"| `{name}` | " + (f"{pct_cell(bo.gpu_utilization)} | {usd(bo.cost_per_1m_tokens_usd)}" if bo else "— | —")
            + f" | {o.throughput_tokens_per_s:,.0f} | "
            + ("n/a" if m.full_engine_tps[name] is None else f"{m.full_engine_tps[name]:,.0f}")
            + f" | {pct_cell(_load(m, name))} | {pct_cell(o.gpu_utilization)} | {pct_cell(e.mfu)} | "
            f"{pct_cell(e.mbu)} | {usd(o.cost_per_1m_tokens_usd)} | {sec_cell(o.queue_wait_ms.p99)} |")
    return "\n".join([
        "| workload (`aps`) | batch engine: busy (%) | batch engine: cost per 1M tokens (USD) | continuous: "
        "throughput (tok/s) | a full engine (tok/s) | throughput / full engine (%) | busy (%) | MFU (%) | MBU (%) | "
        "cost per 1M tokens (USD) | p99 queue wait (s) |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *lines,
    ])


def _utilisation(m: Measured) -> tuple[str, str]:
    """The utilisation verdict: (bullet, paragraph)."""
    loads = {name: _load(m, name) for name in WORKLOADS}
    batch_busy = [m.run(BATCH, name, "aps").overall.gpu_utilization or 0.0 for name in WORKLOADS]
    # Under aps+fixed the window is one constant: which workloads never made a request wait longer?
    fixed = {name: _cont(m, name, "aps+fixed").overall for name in WORKLOADS}
    window_ms = known(fixed[WORKLOADS[0]].governor.mean_window_ms)
    quiet = [name for name in WORKLOADS if (fixed[name].queue_wait_ms.max or 0.0) <= window_ms + WINDOW_ROUNDING_MS]
    light = [name for name in WORKLOADS if (load := loads[name]) is not None and load < LIGHT_LOAD]
    heaviest = max(WORKLOADS, key=lambda n: loads[n] or 0.0)
    busy = [name for name in WORKLOADS if (_cont(m, name).overall.gpu_utilization or 0) >= CLAIMED_GPU_UTILIZATION]
    busy_light = [name for name in busy if name in light]
    all_runs = [(name, s) for name in continuous_names() for s in m.results[CONTINUOUS][name]]
    mfu_name, mfu_run = max(all_runs, key=lambda r: r[1].engine.mfu or 0.0)
    mfus = [mfu for n in busy_light if (mfu := _cont(m, n).engine.mfu) is not None]
    mbus = [mbu for n in busy_light if (mbu := _cont(m, n).engine.mbu) is not None]
    scaled_loads = ", ".join(f"`{s.name}` {pct(_load(m, s.name))}" for s in SCALED)
    claimed, light_share = percent(CLAIMED_GPU_UTILIZATION), percent(LIGHT_LOAD)
    paragraph = (
        f"On the continuous engine, {len(light)} of the {len(WORKLOADS)} design workloads use less than "
        f"{light_share} of a full engine (the most loaded is `{heaviest}` at {pct(loads[heaviest])}; a full engine "
        f"is {m.configs[CONTINUOUS].engine.max_sequences} sequences of the workload's mean request run together, "
        f"the roofline's static-batch estimate), against busy times of {pct(min(batch_busy))} to "
        f"{pct(max(batch_busy))} on the batch engine: "
        + ("under `aps+fixed`, no request of " + ("any of them" if len(quiet) == len(WORKLOADS) else names(quiet))
           + f" waits longer than the {window_ms:g} ms batch window. " if quiet else "")
        + "The scaled variants reach "
        f"{scaled_loads} of a full engine, which is what an overload looks like: the measured ceiling agrees "
        "with the estimate. "
        + (f"Busy time stops measuring load: {names(busy_light)} keep the engine busy "
           f"{pct(min(_cont(m, n).overall.gpu_utilization or 0.0 for n in busy_light))} of the time or more while "
           "it runs at a fraction of its capacity, because a continuous engine steps whenever one sequence "
           f"decodes; their MFU is {pct(min(mfus))} to {pct(max(mfus))}, their MBU {pct(min(mbus))} to "
           f"{pct(max(mbus))}: their steps are bound by memory bandwidth. " if busy_light and mfus and mbus else "")
        + f"MFU is the measure that means something here, and the highest measured is {pct(mfu_run.engine.mfu)} "
        f"(`{mfu_run.label}` on `{mfu_name}`, MBU {pct(mfu_run.engine.mbu)}): the design's claimed \"{claimed} "
        "utilization\" is reached as busy time by a lightly loaded engine, and as FLOP utilization by no run, "
        "even overloaded.")
    bullet = (f"**Utilisation** changes meaning: busy time reads ≥ {claimed} on {len(busy)} of {len(WORKLOADS)} "
              f"design workloads, {len(busy_light)} of them at under {light_share} of a full engine; MFU, measured "
              f"now, peaks at {pct(mfu_run.engine.mfu)} overloaded.")
    return bullet, paragraph


def _cost(m: Measured) -> tuple[str, str]:
    """The cost verdict: (bullet, paragraph)."""
    d = m.deployment
    all_runs = [(name, s) for name in continuous_names() for s in m.results[CONTINUOUS][name]]
    costs = [(name, s, cost) for name, s in all_runs if (cost := s.overall.cost_per_1m_tokens_usd) is not None]
    cheap_name, cheap, lowest = min(costs, key=lambda r: r[2])
    dear_name, dear, _ = max(costs, key=lambda r: r[2])
    batch_price = m.configs[BATCH].gpu.price_per_hour_usd
    at_batch_price = lowest * batch_price / d.price_per_hour_usd
    full_tps = {n: tps for n in continuous_names() if (tps := m.full_engine_tps[n])}
    floor_name = max(full_tps, key=full_tps.__getitem__)
    floor = d.price_per_hour_usd / 3600 / full_tps[floor_name] * 1e6
    claimed = usd(CLAIMED_COST_PER_1M_TOKENS_USD)
    holds = lowest <= CLAIMED_COST_PER_1M_TOKENS_USD
    step_one, step_full = _decode_step_ms(m)
    batch_best = min(s.overall.cost_per_1m_tokens_usd for name in WORKLOADS for s in m.results[BATCH][name]
                     if s.overall.cost_per_1m_tokens_usd is not None)
    max_sequences = m.configs[CONTINUOUS].engine.max_sequences
    paragraph = (
        f"Cost per 1M output tokens on the continuous engine runs from {usd(lowest)} (`{cheap.label}` on "
        f"`{cheap_name}`, {pct(_load(m, cheap_name, cheap.label))} of a full engine) to "
        f"{usd(dear.overall.cost_per_1m_tokens_usd)} (`{dear.label}` on `{dear_name}`, "
        f"{pct(_load(m, dear_name, dear.label))}), at the profile's ${d.price_per_hour_usd:.2f} per GPU-hour "
        f"(at the batch engine's ${batch_price:.2f}, the lowest would be {usd(at_batch_price)}). "
        + (f"The design's claimed {claimed} is reached, which the batch engine could not do (its lowest: "
           f"{usd(batch_best)}), but only by an engine kept full: " if holds else
           f"The design's claimed {claimed} is not reached even here (the batch engine's lowest: "
           f"{usd(batch_best)}); ")
        + f"a decode step of one sequence takes {step_one:.1f} ms and one of {max_sequences} sequences "
        f"{step_full:.1f} ms, so an engine running few sequences pays for most of a step per token. A full engine "
        f"of `{floor_name}`'s mean request ({m.shapes[floor_name][0]} in / {m.shapes[floor_name][1]} out) would "
        f"produce {m.full_engine_tps[floor_name]:,.0f} tokens/s, {usd(floor)} per 1M tokens. Cost is charged for "
        "busy time, as the batch engine does; a GPU rented by the hour also costs its idle time, which these "
        "figures leave out.")
    bullet = (f"**Cost per 1M tokens** changes: from {usd(batch_best)} at best on the batch engine to "
              f"{usd(lowest)} at best here (at ${d.price_per_hour_usd:.2f}/GPU-hour), so the design's claimed "
              f"{claimed} " + ("is reached, " if holds else "is still not reached, ")
              + "but only with the engine full; lightly loaded, up to "
              + f"{usd(dear.overall.cost_per_1m_tokens_usd)}.")
    return bullet, paragraph


def _starvation(m: Measured, alpha: float) -> tuple[str, str]:
    variant = next(s for s in SCALED if s.workload == "vip-flood")
    labels = m.results[BATCH]["vip-flood"].labels

    def worst(engine: str, name: str, label: str) -> float | None:
        return m.run(engine, name, label).overall.lowest_bidder.max_queue_wait_ms

    rows = [f"| `{label}` | {sec_cell(worst(BATCH, 'vip-flood', label))} | "
            f"{sec_cell(worst(CONTINUOUS, 'vip-flood', label))} | {sec_cell(worst(CONTINUOUS, variant.name, label))} | "
            f"{sec_cell(_cont(m, variant.name, label).overall.queue_wait_ms.p99)} |"
            for label in labels]
    default_worst = max(worst(CONTINUOUS, "vip-flood", label) or 0.0 for label in labels)
    params = _cont(m, "vip-flood").workload.params
    gap = (params["vip_bid"] - params["free_bid"]) / alpha if alpha else math.inf

    def ranking(engine: str, name: str) -> list[str]:
        return sorted(labels, key=lambda label: (worst(engine, name, label) or 0.0, label))

    same = ranking(BATCH, "vip-flood") == ranking(CONTINUOUS, variant.name)
    st, ap, ff = (worst(CONTINUOUS, variant.name, x) for x in ("static", "aps", "fifo"))
    bap, bff = (worst(BATCH, "vip-flood", x) for x in ("aps", "fifo"))
    best = min(labels, key=lambda label: worst(CONTINUOUS, variant.name, label) or 0.0)
    best_text = (f", `{best}` {seconds(worst(CONTINUOUS, variant.name, best))}"
                 if best not in ("static", "aps", "fifo") else "")
    text = (
        f"At the default rates the flood is {pct(_load(m, 'vip-flood', 'fifo'))} of a full continuous engine, "
        f"and nobody starves: the bid-1 tenant's longest wait is {seconds(default_worst)} under every policy "
        "(the batch window). "
        f"With `{variant.name}` ({pct(_load(m, variant.name, 'fifo'))} of a full engine) the batch engine's "
        f"picture returns: static priority makes it wait {seconds(st)} at worst, APS {seconds(ap)} "
        f"({change(ap, st)}), FIFO {seconds(ff)}" + best_text
        + f"; {'the same ranking as' if same else 'a different ranking from'} the batch engine's. "
        f"APS's bound is in seconds of waiting, not in work: a bid-{params['free_bid']} request passes "
        f"bid-{params['vip_bid']} requests that arrived more than {gap:g} s after it (alpha = {alpha:g}), "
        f"whatever the engine's speed. Its excess over FIFO is {seconds(known(ap) - known(ff))} ({change(ap, ff)}) "
        f"here and {seconds(known(bap) - known(bff))} ({change(bap, bff)}) on the batch engine: on a faster "
        f"engine the same bound is a larger share of the wait "
        f"(`{report_dir(CONTINUOUS, variant.name).as_posix()}/queue_wait.png` shows every request's wait).")
    bullet = (f"**Starvation** needs an overload, which the design's `vip-flood` is not on this engine: the bid-1 "
              f"tenant waits at most {seconds(default_worst)} under every policy. With `{variant.name}` it returns, "
              f"and so do the batch engine's bounds: at worst static {seconds(st)}, APS {seconds(ap)}, FIFO "
              f"{seconds(ff)}" + best_text
              + f" ({'the same' if same else 'not the same'} ranking as on the batch engine).")
    return bullet, "\n".join([
        "**Starvation** (the lowest bidder's longest queue wait).",
        "",
        f"| policy | batch engine `vip-flood` (s) | continuous `vip-flood` (s) | continuous `{variant.name}` (s) | "
        f"`{variant.name}` everyone's p99 wait (s) |",
        "|:---|---:|---:|---:|---:|", *rows, "",
        text,
    ])


def _governor(m: Measured) -> tuple[str, str]:
    """The governor verdict. On the batch engine ``aps`` runs the entropy governor; on the continuous
    engine, which forms its own batches, it runs no window at all (the shipped behaviour unless a
    window is configured), so there the comparison with ``aps+fixed`` is no window against 10 ms."""
    rows = []
    ttft_helped: list[str] = []
    latency_helped = {engine: 0 for engine in ENGINES}
    zero_best: list[str] = []
    window_is_wait: list[str] = []
    kept = 1 - MATERIAL_CHANGE  # a time below this fraction of the control's was lowered materially
    for name in GOVERNOR_WORKLOADS:
        for engine in ENGINES:
            eo, fo = m.run(engine, name, "aps").overall, m.run(engine, name, "aps+fixed").overall
            zo = m.zero_window[engine][name].overall
            g = eo.governor
            entropy = "—" if g.mean_entropy_bits is None else f"{g.mean_entropy_bits:.2f}"
            window = "none" if g.mean_window_ms is None or g.time_in_state.keys() == {"NONE"} else f"{g.mean_window_ms:.2f}"
            rows.append(
                f"| `{name}` | {engine} | {entropy} | {window} | "
                f"{sec_cell(eo.queue_wait_ms.p50)} vs {sec_cell(fo.queue_wait_ms.p50)} | "
                f"{sec_cell(eo.ttft_ms.p50)} vs {sec_cell(fo.ttft_ms.p50)} ({change(eo.ttft_ms.p50, fo.ttft_ms.p50)}) | "
                f"{sec_cell(eo.ttft_ms.p99)} vs {sec_cell(fo.ttft_ms.p99)} | "
                f"{sec_cell(eo.latency_ms.p99)} vs {sec_cell(fo.latency_ms.p99)} "
                f"({change(eo.latency_ms.p99, fo.latency_ms.p99)}) | {sec_cell(zo.ttft_ms.p50)} |")
            if known(eo.latency_ms.p99) < known(fo.latency_ms.p99) * kept:
                latency_helped[engine] += 1
            if engine == CONTINUOUS:
                entropy_ttft, fixed_ttft = known(eo.ttft_ms.p50), known(fo.ttft_ms.p50)
                if entropy_ttft < fixed_ttft * kept:
                    ttft_helped.append(f"`{name}` {change(entropy_ttft, fixed_ttft)}")
                if known(zo.ttft_ms.p50) <= min(entropy_ttft, fixed_ttft):
                    zero_best.append(f"`{name}`")
                if abs(known(fo.queue_wait_ms.p50) - known(fo.governor.mean_window_ms)) < WINDOW_MATCH_MS:
                    window_is_wait.append(name)
    overload = []
    for s in SCALED:
        e, f = _cont(m, s.name, "aps").overall, _cont(m, s.name, "aps+fixed").overall
        e_p99, f_p99 = known(e.latency_ms.p99), known(f.latency_ms.p99)
        overload.append(abs((e_p99 - f_p99) / f_p99))
    n = len(GOVERNOR_WORKLOADS)
    material = percent(MATERIAL_CHANGE)
    text = (
        f"On the batch engine the entropy governor changed p99 latency by more than {material} on "
        f"{latency_helped[BATCH]} of {n} workloads: a batch takes seconds and the window at most 10 ms. The "
        "continuous engine forms its own batches, so apsd waits out no window for it unless one is configured "
        "(`aps` there runs with none). With the fixed 10 ms window a request waits in the queue for the window and "
        "no longer while the engine has room"
        + (f" (the median wait is 10 ms on {names(window_is_wait)})" if window_is_wait else "")
        + ", and the window is a step or more of added time to first token: without it, median TTFT was lower by "
        f"more than {material} on {len(ttft_helped)} of {n} workloads"
        + (f" ({listing(ttft_helped)})" if ttft_helped else "")
        + f". A fixed 0 ms window (last column; run for this paragraph only) is the same as none: the lowest median "
        f"TTFT on {len(zero_best)} of {n} workloads on the continuous engine. p99 latency moved by more than "
        f"{material} on {latency_helped[CONTINUOUS]} of {n} there, and by at most {max(overload) * 100:.1f}% under "
        "the scaled overloads: congestion is decided by load against capacity on both engines, and no window "
        "prevents it.")
    bullet = (f"**The batch window**: on the batch engine the entropy governor moved p99 latency by more than "
              f"{material} on {latency_helped[BATCH]} of {n} workloads. On the continuous engine apsd runs no window "
              f"unless one is configured: against a fixed 10 ms window that lowered median TTFT by more than "
              f"{material} on {len(ttft_helped)} of {n} workloads. No window prevents congestion.")
    return bullet, "\n".join([
        "**The batch window** (`aps` vs `aps+fixed`, a fixed 10 ms window; `aps` runs the entropy governor on the "
        "batch engine and no window on the continuous engine).",
        "",
        "| workload | engine | mean entropy (bits) | mean window (ms) | p50 queue wait, aps vs fixed (s) | "
        "p50 TTFT, aps vs fixed (s) | p99 TTFT, aps vs fixed (s) | p99 latency, aps vs fixed (s) | "
        "p50 TTFT, fixed 0 ms (s) |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        text,
    ])


def _fairness(m: Measured) -> tuple[str, str]:
    variant = next(s for s in SCALED if s.workload == "vtc-overload")
    during = m.overload[report_dir(CONTINUOUS, variant.name).as_posix()]
    runs = during.runs
    labels = list(runs)
    best = max(labels, key=lambda label: (runs[label].jain or 0.0, label == "fifo"))
    fifo = runs["fifo"]
    tenants = list(fifo.tokens)

    def ttfts(label: str) -> str:
        t = _cont(m, variant.name, label).tenants
        return " and ".join(f"{seconds(t[name].ttft_ms.p50)}" for name in tenants)

    line = (f"| `{variant.name}`, served by t = {during.at:.1f} s | "
            + " | ".join(jain_cell(runs[label].jain) for label in labels) + " |")
    better = (runs[best].jain or 0.0) >= (fifo.jain or 0.0) + JAIN_TIE
    text = (
        f"At the last arrival of `{variant.name}` (t = {during.at:.1f} s), `fifo` had served "
        + " and ".join(f"`{t}` {n:,}" for t, n in fifo.tokens.items())
        + f" output tokens (Jain {jain_cell(fifo.jain)}; median TTFT {ttfts('fifo')}). "
        + (f"`{best}` had served them " + " and ".join(f"{runs[best].tokens.get(t, 0):,}" for t in tenants)
           + f" (Jain {jain_cell(runs[best].jain)}; median TTFT {ttfts(best)}): as on the batch engine, the "
           "most even service while the overload lasts. The batch engine's conclusion holds."
           if better else "No policy served them more evenly than FIFO while the overload lasted."))
    bullet = (f"**Fairness under overload** holds: on `{variant.name}`, `{best}` served the tenants with Jain "
              f"{jain_cell(runs[best].jain)} while the overload lasted, FIFO {jain_cell(fifo.jain)}."
              if better else f"**Fairness under overload**: no policy was more even than FIFO on `{variant.name}`.")
    return bullet, "\n".join([
        "**Fairness while overloaded** (Jain's index of the tokens served by the last arrival, as above).",
        "",
        "| Jain's index | " + " | ".join(f"`{label}`" for label in labels) + " |",
        "|:---|" + "---:|" * len(labels), line, "",
        text,
    ])


def continuous_section(m: Measured, config: Config) -> list[str]:
    util_bullet, utilisation = _utilisation(m)
    cost_bullet, cost = _cost(m)
    alpha = parse_section(ApsParams, config.policy.params.get("aps", {}), "policy.aps").alpha
    starvation_bullet, starvation = _starvation(m, alpha)
    governor_bullet, governor = _governor(m)
    fairness_bullet, fairness = _fairness(m)
    claimed_utilization, claimed_cost = percent(CLAIMED_GPU_UTILIZATION), usd(CLAIMED_COST_PER_1M_TOKENS_USD)
    return [
        "## On a continuous engine: which conclusions change",
        "",
        _intro(m, config),
        "",
        "What changes, in short (each computed from the runs below):",
        "",
        f"- {util_bullet}\n- {cost_bullet}",
        f"- {governor_bullet}",
        f"- {starvation_bullet}",
        f"- {fairness_bullet}",
        "",
        "Load, utilisation and cost, per workload, under `aps`:",
        "",
        _load_table(m),
        "",
        f"**Utilisation** (\"{claimed_utilization} GPU utilization\").\n\n" + utilisation
        + f"\n\n**Cost** (\"{claimed_cost} per 1M tokens\").\n\n" + cost,
        "",
        starvation,
        "",
        governor,
        "",
        fairness,
        "",
    ]
