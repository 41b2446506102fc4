import json, glob, os, statistics
R = '/work/bench/results'
def load(n):
    p = f'{R}/{n}.json'
    try:
        return json.load(open(p))
    except Exception as e:
        return None
rows = []
for kind in ('io', 'store', 'cons'):
    for i in (1, 2, 3):
        for side in ('before', 'after'):
            d = load(f'{kind}-{side}-{i}')
            if d is None:
                rows.append((kind, side, i, 'missing')); continue
            if kind == 'io':
                b = d['best_peer']
                rows.append((kind, side, i, f"read engine/best {b['read']['engine_vs_best']} ({b['read']['engine_gbps']} vs {b['read']['method']} {b['read']['gbps']} GB/s), write engine/best {b['write']['engine_vs_best']} ({b['write']['engine_gbps']} vs {b['write']['method']} {b['write']['gbps']}); load {d['environment']['loadavg_before'][0]}->{d['environment']['loadavg_after'][0]}"))
            elif kind == 'store':
                rows.append((kind, side, i, f"compute-bound wall/bound {d['compute_bound']['median_wall_over_bound']:.3f} (median wall {d['compute_bound']['median_wall_s']:.2f} s), io-bound wall/bound {d['io_bound']['median_wall_over_bound']:.3f} (median wall {d['io_bound']['median_wall_s']:.2f} s); fio mixed {d['fio']['mixed']['gbps']:.2f} GB/s"))
            else:
                keys = {k: d.get(k) for k in ('speedup', 'rss_ratio', 'outputs_equal', 'goals_met')}
                m = d['methods']; t = d['throughput']
                rows.append((kind, side, i, f"speedup {d['speedup']:.2f}x, rss ratio {d['rss_ratio']:.3f}, equal {d['outputs_equal']['equal']}; ours wall median {m['ours']['wall_s_median']} s (runs {m['ours']['wall_s_runs']}), zero_to_fp32 {m['deepspeed']['wall_s_median']} s; ours/disk bound {t['ours_wall_over_disk_bound']:.2f}; load {d['environment'].get('loadavg_before')}"))
for r in rows:
    print(*r)
