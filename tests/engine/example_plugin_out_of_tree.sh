#!/usr/bin/env bash
# Installs memrt into a fresh prefix, builds examples/loss_guard out of tree against the installed
# SDK, names it in a ds_config.json, trains, and checks that its hooks ran in the documented order
# and that its effect (skipped steps) shows in the log and in metrics.jsonl.
#   example_plugin_out_of_tree.sh <source dir> <build dir>
set -euo pipefail
src=$1
build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step() {  # step <log name> <command...>: runs it, shows its log if it fails
  local log="$work/$1.log"; shift
  "$@" > "$log" 2>&1 || { echo "FAIL: $*"; cat "$log"; exit 1; }
}
step install cmake --install "$build" --prefix "$work/prefix"
step configure cmake -S "$src/examples/loss_guard" -B "$work/plugin" -G Ninja \
     -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix"
step build cmake --build "$work/plugin"
test -f "$work/plugin/libloss_guard.so"

# factor 0: after 3 warm-up steps every step's loss exceeds 0 x the running mean -> skipped.
cat > "$work/ds.json" <<JSON
{
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "plugins": [{"name": "loss_guard", "library": "plugin/libloss_guard.so",
               "options": {"factor": 0.0, "warmup_steps": 3, "window": 4}}]
}
JSON
cat > "$work/train.yaml" <<YAML
model: {arch: gpt2, n_layer: 2, n_head: 2, n_kv_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, n_ctx: 16}
block_size: 16
max_steps: 6
logging_steps: 1
output_dir: $work/out
YAML
"$work/prefix/bin/launcher" --trace-hooks --deepspeed "$work/ds.json" "$work/train.yaml" \
    > "$work/stdout.log" 2> "$work/trace.log"

fail() { echo "FAIL: $*"; echo "--- stdout"; cat "$work/stdout.log"; echo "--- trace (head)"; head -60 "$work/trace.log"; exit 1; }

skips=$(grep -c "update skipped (loss_guard: loss" "$work/stdout.log" || true)
[ "$skips" = 3 ] || fail "expected 3 skipped steps in the log, found $skips"
last=$(tail -n 1 "$work/out/metrics.jsonl")
echo "$last" | grep -q '"loss_guard_skips": 3' || fail "metrics.jsonl last line lacks loss_guard_skips 3: $last"
echo "$last" | grep -q '"skipped_steps": 3' || fail "metrics.jsonl last line lacks skipped_steps 3: $last"

# The plugin's own hooks, in the order of the loop in memrt/plugin.h, for the first step (and the
# checkpoint saved after the last: its state and files).
order=$(grep "^\[hook\] loss_guard/" "$work/trace.log" | sed 's/^\[hook\] loss_guard\///' |
        awk '!seen[$0]++' | tr '\n' ' ')
want="configure plan_params estimate_memory plan_store estimate_planned_memory on_block_ready transform_model build_optimizer on_train_begin before_forward before_segment_forward after_segment_forward after_forward before_backward before_segment_backward after_segment_backward after_backward after_gradient_accumulation before_optimizer_step after_optimizer_step add_metrics state_dict write_checkpoint_files on_train_end "
[ "$order" = "$want" ] || fail "hook order
  got:  $order
  want: $want"
# Its memory: a term of its own in the estimate (4 losses of 8 bytes, claimed as "other"), in the
# end-of-run report and in `launcher --estimate`.
term='"source": "loss_guard", "categories": {[^]]*"other": {"device": 32, "host": 0}'
grep -q "$term" "$work/out/memory_report.json" || fail "memory_report.json lacks loss_guard's term (other +32 bytes)"
"$work/prefix/bin/launcher" --estimate --num_procs 2 --deepspeed "$work/ds.json" "$work/train.yaml" \
    > "$work/estimate.log" 2>&1 || { cat "$work/estimate.log"; fail "--estimate failed"; }
grep -q "^  loss_guard " "$work/estimate.log" || { cat "$work/estimate.log"; fail "--estimate lists no loss_guard term"; }
[ "$(grep -c "$term" "$work/out/memory_estimate.json")" = 3 ] ||
  fail "memory_estimate.json should hold loss_guard's term for each of its 3 ranks (world sizes 1 and 2)"

echo "1 passed, 0 failed"
