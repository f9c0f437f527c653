"""Convert a BigMoeOnEdge `route_trace v1` CSV into a prefetch-routing-trace/1 JSON file.

Input: one `<tag>.route.csv` written by BigMoeOnEdge's `bmoe-cli --route-trace` (repository
Helldez/BigMoeOnEdge, Apache-2.0; e.g. docs/bench-data/2026-07-15-route-trace/qwen.route.csv, read
out of a fetched snapshot with `git show COMMIT:PATH > qwen.route.csv`). Its rows are
`turn,phase,step,layer,slot,expert,...`: phase 0 = the batched prompt (prefill), phase 1 = one decode
token per step, `step` = the token's context position, `layer` counted in MoE layers.

Output: a JSON trace (docs/trace_format.md) whose step 0 is the union, per layer, of the experts the
prompt's tokens routed to, and whose later steps are the decode tokens in position order, one each,
plus a `source` block naming the repository, path, commit, license and the run's model and top-k.

usage: python convert_bigmoeonedge.py IN.csv OUT.json --path REPO_PATH --commit SHA [--max-decode N]
"""
import argparse
import csv
import json
import re


def convert(src, path, commit, max_decode=None):
    with open(src, encoding="utf-8") as f:
        lines = f.read().splitlines()
    head = [line for line in lines if line.startswith("# model=")]
    if len(head) != 1:
        raise SystemExit(f"{src}: expected one '# model=' line, found {len(head)}")
    meta = dict(re.findall(r"(\w+)=(\S+)", head[0]))
    n_layers, n_experts = int(meta["n_layer"]), int(meta["n_expert"])
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    turns = {r["turn"] for r in rows}
    if turns != {"0"}:
        raise SystemExit(f"{src}: one-shot runs only (turn 0), found turns {sorted(turns)}")
    prefill = [set() for _ in range(n_layers)]
    decode = {}
    for r in rows:
        layer, expert = int(r["layer"]), int(r["expert"])
        if r["phase"] == "0":
            prefill[layer].add(expert)
        elif r["phase"] == "1":
            decode.setdefault(int(r["step"]), [set() for _ in range(n_layers)])[layer].add(expert)
        else:
            raise SystemExit(f"{src}: unknown phase {r['phase']!r}")
    positions = sorted(decode)
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise SystemExit(f"{src}: decode positions are not consecutive")
    kept = positions if max_decode is None else positions[:max_decode]
    steps = [[sorted(x) for x in prefill]] + [[sorted(x) for x in decode[p]] for p in kept]
    return {
        "format": "prefetch-routing-trace/1",
        "num_layers": n_layers,
        "num_experts": n_experts,
        "steps": steps,
        "source": {
            "repo": "Helldez/BigMoeOnEdge", "path": path, "commit": commit, "license": "Apache-2.0",
            "model": meta["model"].split("/")[-1], "arch": meta["arch"],
            "top_k_used": int(meta["n_expert_used"]),
            "decode_steps_in_source": len(positions), "decode_steps_kept": len(kept),
            "note": "step 0 is the union of the prompt tokens (batched prefill); later steps are single "
                    "decode tokens, batch 1, greedy",
        },
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--path", required=True, help="the CSV's path in the source repository")
    ap.add_argument("--commit", required=True, help="the source repository's commit")
    ap.add_argument("--max-decode", type=int, default=None)
    args = ap.parse_args()
    out = convert(args.src, args.path, args.commit, args.max_decode)
    with open(args.dst, "w", encoding="utf-8") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(args.dst, out["num_layers"], "x", out["num_experts"], len(out["steps"]), "steps")


if __name__ == "__main__":
    main()
