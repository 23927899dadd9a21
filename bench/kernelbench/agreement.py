"""Run-to-run agreement of two evaluator-kernelbench result files: eager and candidate medians, ops over 0.1 ms.

    python bench/kernelbench/agreement.py RUN_A.jsonl RUN_B.jsonl

Prints one row per (task, backend) in both files, then how many ops over 0.1 ms agree within 3%.
"""

import json
import sys


def load(p):
    out = {}
    with open(p) as f:
        for line in f:
            r = json.loads(line)
            if r.get("eager_median_ms"):
                out[(r["task"], r["backend"])] = (r["eager_median_ms"], r.get("candidate_median_ms"))
    return out


a, b = load(sys.argv[1]), load(sys.argv[2])
ok_e = ok_c = n_e = n_c = 0
print(f"{'task':<50} {'backend':<15} {'eager A':>9} {'eager B':>9} {'diff':>7} {'cand A':>9} {'cand B':>9} {'diff':>7}")
for key in sorted(a.keys() & b.keys()):
    (ea, ca), (eb, cb) = a[key], b[key]
    de = abs(ea - eb) / ea
    dc = abs(ca - cb) / ca if ca and cb else None
    if ea > 0.1:
        n_e += 1
        ok_e += de <= 0.03
    if ca and ca > 0.1 and dc is not None:
        n_c += 1
        ok_c += dc <= 0.03
    print(
        f"{key[0]:<50} {key[1]:<15} {ea:>9.4f} {eb:>9.4f} {100 * de:>6.2f}% "
        f"{ca or 0:>9.4f} {cb or 0:>9.4f} {100 * (dc or 0):>6.2f}%"
    )
print(f"# same machine, ops > 0.1 ms within 3%: eager {ok_e}/{n_e}, candidate {ok_c}/{n_c}")
