"""Statistics of `host_sync_probe.py`'s samples: quantiles, a five-number summary, the two-level split of a call's
times (with the clocks and throttle readings of each level), rank correlation, and joining samples to the NVML
readings before them."""

import bisect
import itertools
import statistics


def quantile(values, p):
    s, x = sorted(values), p * (len(values) - 1)
    return s[int(x)] + (s[min(int(x) + 1, len(s) - 1)] - s[int(x)]) * (x - int(x))


def summary(values):
    med = quantile(values, 0.5)
    return {
        "n": len(values),
        "median": med,
        "p20": quantile(values, 0.2),
        "p80": quantile(values, 0.8),
        "iqr_pct": 100 * (quantile(values, 0.75) - quantile(values, 0.25)) / med if med else None,
    }


def two_means(values):
    """Exact 1-D 2-means: the midpoint of the split of the sorted values with the least within-group sum of squares;
    None with fewer than two distinct values."""
    s = sorted(values)
    n = len(s)
    if n < 2 or s[0] == s[-1]:
        return None
    pre, pre2 = [0.0], [0.0]
    for v in s:
        pre.append(pre[-1] + (v - s[0]))
        pre2.append(pre2[-1] + (v - s[0]) ** 2)
    best = None
    for k in range(1, n):
        if s[k] == s[k - 1]:
            continue  # no split between equal values
        sse = pre2[k] - pre[k] ** 2 / k + (pre2[n] - pre2[k]) - (pre[n] - pre[k]) ** 2 / (n - k)
        if best is None or sse < best[0]:
            best = (sse, k)
    # s[0] != s[-1]: some k splits, so best is set.
    return (s[best[1] - 1] + s[best[1]]) / 2  # pyright: ignore[reportOptionalSubscript]


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def levels(samples, sm=None, power=None, pstate=None, reasons=None):
    """The samples (ms, call order) split in a low and a high cost level, with what NVML read per call (lists
    parallel to samples, None where unknown)."""
    if not samples:
        return None
    lo, hi = quantile(samples, 0.02), quantile(samples, 0.98)
    split = two_means([min(max(v, lo), hi) for v in samples])
    side = [split is not None and v > split for v in samples]
    out = {"split_ms": split, "switches": sum(a != b for a, b in itertools.pairwise(side))}
    for name, flag in (("low", False), ("high", True)):
        idx = [i for i, s in enumerate(side) if s == flag]

        def pick(col, idx=idx):
            return [col[i] for i in idx if col[i] is not None] if col is not None else []

        reasons_or = None
        for r in pick(reasons):
            reasons_or = r if reasons_or is None else reasons_or | r
        out[name] = {
            "n": len(idx),
            "median_ms": median_or_none([samples[i] for i in idx]),
            "median_sm_mhz": median_or_none(pick(sm)),
            "median_power_mw": median_or_none(pick(power)),
            "pstates": sorted(set(pick(pstate))),
            "reasons_or": reasons_or,
        }
    low, high = out["low"]["median_ms"], out["high"]["median_ms"]
    out["gap_pct"] = 100 * (high - low) / low if low and high is not None else None
    return out


def ranks(values):
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    r, i = [0.0] * len(values), 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(a, b):
    """Spearman's rank correlation over the pairs where neither is None; None with fewer than 3 or a constant side."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    ra, rb = ranks([x for x, _ in pairs]), ranks([y for _, y in pairs])
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    sab = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    saa, sbb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return sab / (saa * sbb) ** 0.5 if saa > 0 and sbb > 0 else None


def join_earlier(times, stamps):
    """For each stamp, the index of the last of the (sorted) times at or before it; None if there is none."""
    return [i if i >= 0 else None for i in (bisect.bisect_right(times, s) - 1 for s in stamps)]
