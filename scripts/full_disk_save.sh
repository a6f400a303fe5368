#!/usr/bin/env bash
# A checkpoint save on a really full filesystem (issue 47, item 4), where CI can only fail the write
# on purpose (tests/train/test_checkpoint_faults.py). Mounts a 1 MiB tmpfs, which needs root (or
# CAP_SYS_ADMIN), and trains a tiny Qwen3 at CP=2 (2 gloo ranks) with a checkpoint every 2 steps
# there: step 2's checkpoint (~0.6 MB) fits, step 4's does not. Checks that the run ends with exit
# status 2 and one line naming the full disk and what the checkpoint needed, that step-2 is left
# intact and is the latest complete step, with no step-4 or step-4.partial, and that a resume from
# it passes the start-up checks. Prints what it saw; exit status 0 when all of that held, 77 when
# it cannot mount.
#
#   sudo bash scripts/full_disk_save.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
work=$(mktemp -d)
mnt="$work/full"
mkdir "$mnt"
if ! mount -t tmpfs -o size=1m tmpfs "$mnt" 2>/dev/null; then
  echo "full_disk_save.sh: cannot mount a tmpfs here (needs root); nothing checked" >&2
  rm -rf "$work"
  exit 77
fi
trap 'umount "$mnt"; rm -rf "$work"' EXIT

cat > "$work/train.yaml" <<EOF
model: {model_type: qwen3, vocab_size: 96, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
        num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8}
train: {steps: 6, seq_len: 16, batch_size: 2, lr: 1.0e-3}
accelerator: {cp_size: 2}
plan_overrides:
  - {match: "*.self_attn", when: cp, region_dispatch: false, inner_target: self, inner_wrapper: sdpa_hf}
checkpoint: {folder: $mnt/ckpt, interval: 2}
EOF

set +e
OMP_NUM_THREADS=1 .venv/bin/python -m cpcompile train --nproc-per-node 2 "$work/train.yaml" \
  > "$work/out.txt" 2> "$work/err.txt"
status=$?
set -e
echo "exit status: $status"
echo "stderr ($(wc -l < "$work/err.txt") line(s)):"
cat "$work/err.txt"
echo "left in $mnt/ckpt: $(ls -A "$mnt/ckpt" | tr '\n' ' ')"
df -h "$mnt" | tail -1

failed=0
[ "$status" = 2 ] || { echo "FAIL: exit status $status, not 2"; failed=1; }
[ "$(wc -l < "$work/err.txt")" = 1 ] || { echo "FAIL: not one line"; failed=1; }
grep -q "saving step 4 failed: disk full writing .*the checkpoint needs about" "$work/err.txt" ||
  { echo "FAIL: the line does not name the full disk and the size needed"; failed=1; }
[ -f "$mnt/ckpt/step-2/trainer.json" ] || { echo "FAIL: step-2 is not complete"; failed=1; }
[ ! -e "$mnt/ckpt/step-4" ] && [ ! -e "$mnt/ckpt/step-4.partial" ] || { echo "FAIL: step-4 left behind"; failed=1; }
.venv/bin/python - "$work/train.yaml" <<'EOF' || failed=1
import sys
from cpcompile.trainer import load_train_config
from cpcompile.trainer.startup import check_before_building

step = check_before_building(load_train_config(sys.argv[1]))
print(f"a resume starts from step {step} (the start-up checks pass)")
sys.exit(0 if step == 2 else 1)
EOF
[ "$failed" = 0 ] && echo "full_disk_save.sh: PASS"
exit "$failed"
