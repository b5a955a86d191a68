"""The issue's targets, checked against a results dict: pass, fail, n/a (with the reason), or info."""

ATARI_MINIBATCH = [256, 4, 84, 84]


def ok(r: dict | None) -> dict | None:
    return r if r and r["status"] == "ok" else None


def speedup(algo: dict, fn: str, mode: str) -> float | None:
    eager, other = ok(algo["modes"].get("eager")), ok(algo["modes"].get(mode))
    if eager and other:
        return eager["calls"][fn]["median_ms"] / other["calls"][fn]["median_ms"]
    return None


def update_fns(algo: dict) -> list[str]:
    calls = next((r["calls"] for r in algo["modes"].values() if r["status"] == "ok"), {})
    return [fn for fn in calls if fn.startswith("update")]


def check(results: dict) -> list[dict]:
    algos, scaling = results["algos"], results["scaling"]
    on_gpu, quick = results["machine"]["gpu"] is not None, results["settings"]["quick"]
    out = []

    def target(name, where, values: dict, threshold, text):
        """`values` {label: figure} must all reach `threshold`; `where` is "cpu" or "gpu"."""
        if quick:
            reason = "--quick sizes are not the targets' sizes"
        elif (where == "gpu") != on_gpu:
            reason = "no CUDA" if where == "gpu" else "a CPU target; this run is on a GPU"
        elif not values or None in values.values():
            reason = "not measured in this run"
        else:
            passed = all(v >= threshold for v in values.values())
            out.append(dict(name=name, status="pass" if passed else "fail", values=values,
                            value_text=", ".join(f"{k} {text(v)}".strip() for k, v in values.items())))
            return
        out.append(dict(name=name, status="n/a", reason=reason))

    def x(v):
        return f"{v:.2f}x"

    atari = algos.get("ppo_atari")
    at_size = atari and any(ok(r) and r["calls"]["update"]["input_shapes"][0] == ATARI_MINIBATCH
                            for r in atari["modes"].values())
    target("CPU: compiled PPO update >= 1.8x eager at the Atari minibatch (256x4x84x84)", "cpu",
           {"": speedup(atari, "update", "compile")} if at_size else {}, 1.8, x)
    for name, label in (("td3_continuous", "TD3"), ("sac_continuous", "SAC")):
        algo = algos.get(name)
        target(f"GPU: {label} update functions, compile+cudagraphs >= 5x eager", "gpu",
               {fn: speedup(algo, fn, "compile+cudagraphs") for fn in update_fns(algo)} if algo else {}, 5.0, x)
    best = max(((r["sps"], m) for m, r in atari["modes"].items() if ok(r)), default=None) if atari else None
    target("GPU: PPO-Atari >= 10,000 env-steps/s end to end", "gpu", {f"({best[1]})": best[0]} if best else {},
           10_000, lambda v: f"{v:,.0f}")
    graphed = {f"{name} {fn}": ok(algo["modes"].get("compile+cudagraphs"))["calls"][fn].get("gpu_busy")
               for name, algo in algos.items() if ok(algo["modes"].get("compile+cudagraphs"))
               for fn in update_fns(algo)}
    target("GPU: busy >= 90% of the wall time inside the graphed (compile+cudagraphs) update", "gpu", graphed,
           0.9, lambda v: f"{v:.0%}")
    points = [(p["sps"], m, p["num_envs"]) for s in scaling.values() for m, r in s["modes"].items() if ok(r)
              for p in r["points"]]
    best = max(points, default=None)
    target("GPU: PPO CartPole on device >= 5,000,000 env-steps/s", "gpu",
           {f"({best[1]}, {best[2]} envs)": best[0]} if best else {}, 5_000_000, lambda v: f"{v:,.0f}")

    slower = []
    for name, algo in algos.items():
        for fn, c in (ok(algo["modes"].get("compile")) or {}).get("calls", {}).items():
            if not c.get("kept_eager") and (s := speedup(algo, fn, "compile")) is not None and s < 1:
                slower.append(f"{name} `{fn}` [{'x'.join(map(str, c['input_shapes'][0]))}] {s:.2f}x")
    for name, sc in scaling.items():
        eager, compiled = ok(sc["modes"].get("eager")), ok(sc["modes"].get("compile"))
        compiled_ms = {q["num_envs"]: q["policy_ms"] for q in compiled["points"]} if compiled else {}
        for p in eager["points"] if eager else ():
            if p["num_envs"] in compiled_ms and p["policy_ms"] < compiled_ms[p["num_envs"]]:
                slower.append(f"{name} `policy` at {p['num_envs']} envs "
                              f"{p['policy_ms'] / compiled_ms[p['num_envs']]:.2f}x")
    out.append(dict(name="where compile does not pay (compiled call slower than eager)", status="info",
                    value_text="; ".join(slower) or "nowhere in this run"))
    return out
