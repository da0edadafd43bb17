#!/usr/bin/env bash
# Decode speed of this checkout against an older commit, paired: `specd generate` on the
# Qwen pair, the two versions run in turn (the order alternating), N pairs per config.
#
#   bench/ab_versions.sh OLD_COMMIT [PAIRS]      # prints a table; rows in $OUT/results.tsv
#
# The old commit is checked out in a worktree and imported through PYTHONPATH (a `specd`
# folder of links to its top-level folders), with this checkout's .venv; both use the
# same graph cache where their BUILDER_VERSION agrees.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?usage: bench/ab_versions.sh OLD_COMMIT [PAIRS]}
PAIRS=${2:-6}
OUT=${OUT:-$(mktemp -d)}
PY=.venv/bin/python
git worktree add -f -q "$OUT/old" "$OLD"
mkdir -p "$OUT/pkg/specd"
for d in daemon ort_models ipc memory_fit tray installers; do ln -sfn "$OUT/old/$d" "$OUT/pkg/specd/$d"; done
echo '"""specd at the old commit"""' > "$OUT/pkg/specd/__init__.py"
CODE="Write a Python function that checks whether a number is prime, with a docstring and doctests."
PROSE="Write a 200-word story about a lighthouse keeper who finds a message in a bottle."
: > "$OUT/results.tsv"
run() {  # VERSION CONFIG
  local env=() args=()
  [ "$1" = old ] && env=(PYTHONPATH="$OUT/pkg")
  case $2 in
    code-t0) args=(-md qwen2.5-coder-0.5b-instruct --chat "$CODE") ;;
    prose-t0.7) args=(-md qwen2.5-coder-0.5b-instruct --chat "$PROSE" --temp 0.7 --seed 1234) ;;
    target-only) args=(--chat "$CODE") ;;
  esac
  env "${env[@]}" $PY -m specd.daemon.cli generate -m qwen2.5-coder-1.5b-instruct "${args[@]}" \
      -n 256 --ignore-eos -t 2 >"$OUT/$1-$2.out" 2>"$OUT/$1-$2.err"
  local tps
  tps=$(grep -o "generated [0-9]* tokens, [0-9.]* tok/s" "$OUT/$1-$2.err" | awk '{print $4}')
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$tps" "$(md5sum <"$OUT/$1-$2.out" | cut -c1-8)" \
      >>"$OUT/results.tsv"
}
for i in $(seq "$PAIRS"); do
  for cfg in code-t0 prose-t0.7 target-only; do
    if [ $((i % 2)) = 1 ]; then run new "$cfg"; run old "$cfg"; else run old "$cfg"; run new "$cfg"; fi
  done
done
git worktree remove --force "$OUT/old"
$PY - "$OUT/results.tsv" <<'PY'
import statistics as st, sys
rows = [line.split("\t") for line in open(sys.argv[1]).read().splitlines()]
by: dict = {}
for ver, cfg, tps, digest in rows:
    by.setdefault((cfg, ver), []).append((float(tps), digest))
print("| config | new tok/s | old tok/s | new / old, paired | pairs | greedy output equal |")
print("|---|---|---|---|---|---|")
for cfg in ("code-t0", "prose-t0.7", "target-only"):
    new, old = by[(cfg, "new")], by[(cfg, "old")]
    r = [a / b for (a, _), (b, _) in zip(new, old)]
    same = "" if cfg == "prose-t0.7" else str({d for _, d in new} == {d for _, d in old})
    print(f"| {cfg} | {st.median(t for t, _ in new):.1f} | {st.median(t for t, _ in old):.1f} "
          f"| {st.median(r):.3f} ({min(r):.3f}–{max(r):.3f}) | {len(r)} | {same} |")
PY
