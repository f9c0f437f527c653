"""Convert a SimLLM `simllm-preplay-trace-v2` routing capture (JSONL) into prefetch-routing-trace/1
JSON files, one per request.

Input: a capture such as examples/sglang_composed_deployment_v1/fixtures/routing-trace.jsonl of
openfabric-systems/simllm (Apache-2.0; read out of a fetched snapshot with
`git show COMMIT:PATH > routing-trace.jsonl`). Its `observed-dispatch` rows carry, per request and per
token, the expert ids SGLang dispatched in every MoE layer (`routing[].layer_index`,
`routing[].expert_ids`), with `phase` prefill or decode; the `header` row's `provenance` names the
model, its revision and top-k, and lists the MoE layers (`moe_layer_indices`).

Output: OUTDIR/PREFIX-<request_id>.json for every request: step 0 is the union, per MoE layer, of
the experts the request's prompt tokens routed to; each later step is one decode token of that
request, in token order; a `source` block names the repository, path, commit, license, model and the
request's prompt token ids.

usage: python convert_simllm.py IN.jsonl OUTDIR PREFIX --path REPO_PATH --commit SHA
"""
import argparse
import json
import os


def convert(src, path, commit):
    rows = [json.loads(line) for line in open(src, encoding="utf-8") if line.strip()]
    headers = [r for r in rows if r.get("row_type") == "header"]
    if len(headers) != 1:
        raise SystemExit(f"{src}: expected one header row, found {len(headers)}")
    prov = headers[0]["provenance"]
    moe_layers = prov["moe_layer_indices"]
    position = {layer: i for i, layer in enumerate(moe_layers)}
    n_layers, n_experts = len(moe_layers), int(prov["expert_count"])
    requests = {r["request_id"]: r for r in rows if r.get("row_type") == "request"}
    out = {}
    for rid, req in requests.items():
        prefill = [set() for _ in range(n_layers)]
        decode = {}
        for r in rows:
            if r.get("row_type") != "observed-dispatch" or r["request_id"] != rid:
                continue
            layers = [set() for _ in range(n_layers)]
            for entry in r["routing"]:
                layers[position[entry["layer_index"]]].update(int(e) for e in entry["expert_ids"])
            if r["phase"] == "prefill":
                for acc, got in zip(prefill, layers):
                    acc.update(got)
            elif r["phase"] == "decode":
                if r["token_index"] in decode:
                    raise SystemExit(f"{src}: request {rid} decode token {r['token_index']} twice")
                decode[r["token_index"]] = layers
            else:
                raise SystemExit(f"{src}: unknown phase {r['phase']!r}")
        order = sorted(decode)
        if order != list(range(len(order))):
            raise SystemExit(f"{src}: request {rid} decode tokens are not 0..n-1")
        out[rid] = {
            "format": "prefetch-routing-trace/1",
            "num_layers": n_layers,
            "num_experts": n_experts,
            "steps": [[sorted(x) for x in prefill]] + [[sorted(x) for x in decode[t]] for t in order],
            "source": {
                "repo": "openfabric-systems/simllm", "path": path, "commit": commit,
                "license": "Apache-2.0", "model": prov["model_id"],
                "model_revision": prov["model_revision"], "top_k_used": int(prov["top_k"]),
                "dtype": prov["dtype"], "runner": prov["runner"], "request_id": rid,
                "prompt_token_ids": req["input_token_ids"],
                "note": "step 0 is the union of the request's prompt tokens (prefill); later steps are "
                        "its single decode tokens, greedy. The prompt is a run of consecutive token ids, "
                        "not text",
            },
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("outdir")
    ap.add_argument("prefix")
    ap.add_argument("--path", required=True, help="the capture's path in the source repository")
    ap.add_argument("--commit", required=True, help="the source repository's commit")
    args = ap.parse_args()
    for rid, trace in convert(args.src, args.path, args.commit).items():
        dst = os.path.join(args.outdir, f"{args.prefix}-{rid}.json")
        with open(dst, "w", encoding="utf-8") as f:
            json.dump(trace, f, separators=(",", ":"))
            f.write("\n")
        print(dst, trace["num_layers"], "x", trace["num_experts"], len(trace["steps"]), "steps")


if __name__ == "__main__":
    main()
