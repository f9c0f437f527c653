share=$1; shift
for i in 1 2 3; do
 for side in new old; do
  dir=/work/main; [ $side = old ] && dir=/tmp/old
  (cd $dir && PYTHONPATH=$dir timeout 600 python3 tools/bm5_host_proxy.py traces/gemma4-26b-a4b.json --rounds 2 --share $share --policies "$@" --json /tmp/exp/ab2_${share}_${side}_$i.json > /dev/null 2>&1)
 done
done
python3 - "$share" <<'PY'
import json,sys,statistics,glob
share=sys.argv[1]
for side in ("new","old"):
    d={}
    for f in sorted(glob.glob(f"/tmp/exp/ab2_{share}_{side}_*.json")):
        rows=json.load(open(f))["rows"]
        for r in rows:
            base=[b for b in rows if b["round"]==r["round"] and b["policy"]=="all-resident"][0]
            for ph in ("acquire","compute","speculate","sync","release","other"):
                d.setdefault((r["policy"],ph),[]).append(r["host_us_per_layer"].get(ph,0)-base["host_us_per_layer"].get(ph,0))
            d.setdefault((r["policy"],"x"),[]).append(r["x_resident"])
    for k in sorted(d):
        if k[0]!="all-resident": print(side,k,round(statistics.median(d[k]),2), "n",len(d[k]))
PY
