#!/usr/bin/env bash
# What we run on a CUDA machine (not CI). Sections, chosen by SECTIONS (default: all):
#   tests    the GPU test set (-m gpu): local attention kernels, SDPA regions on CUDA, GDN kernels
#            and layer; with two GPUs, every SDPA method over NCCL (bf16 judged against fp32)
#   attn     benchmarks/local_attention.py: a rank's local attention vs one fused call (one GPU)
#   gdn      benchmarks/gdn_kernels.py and gdn_accuracy.py (fla-core installed for the comparison)
#   packed   packed documents on one GPU (a short run; not in the default): their GPU tests
#            (per-document Head-Tail's FlexAttention at query positions, packed GDN eager and triton),
#            and local_attention.py at 32K with documents, per-document Head-Tail included
#   order    one GPU (a short run; not in the default): where the async methods' launches and waits
#            and GDN State-P2P's messages fall among the kernels on ranks 0, 1 and 2 of 3 (fake process
#            group: order only)
#   trainer  one GPU, the training step (issues 32, 33): the trainer against transformers + fla-core
#            (trainer_vs_hf.py, ~8 min), one rank's device memory through the pretrained load at
#            cp 2/4/8 (load_memory_gpu.py, ~5-8 min), compiled CP layers on CUDA and CP=2..16 ranks
#            (trainer_gpu.py --simulate-cp); each near the 10-minute limit of one device call: run
#            it alone (SECTIONS=trainer TRAINER=vs_hf|load|simulate|compiled_cp|longest|attention|step32k|remaining|
#            pending_a|pending_b|pending_c|next|sixth_a|sixth_b|sixth_c|seventh_a|seventh_b|seventh_c|
#            eighth)
#   multi    with several GPUs: cp_methods.py (every method, equivalence + speed), sdpa_vs_torch_cp.py
#            (no CP / PyTorch's context_parallel / every SDPA method at 8K-128K), overlap_report.py
# Usage: [SECTIONS="tests multi"] bash scripts/gpu_checks.sh OUT_DIR [gdn benchmark seconds]
set -uo pipefail
out=${1:?output folder}
bench_seconds=${2:-380}
sections=${SECTIONS:-tests attn gdn multi}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off on shared multi-GPU hosts (device tool README)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
gpus=$(nvidia-smi -L | wc -l)
has() { [[ " $sections " == *" $1 "* ]]; }
if has tests; then
  timeout 900 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/sdpa tests/gdn \
    tests/train/test_sdpa_backend.py tests/train/test_linear_cross_entropy.py -s \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "vs |errors|passed|failed|Error"
fi
if has attn; then
  timeout 400 python3 benchmarks/local_attention.py --out "$out/local_attention.md" 2>&1 | grep "^|"
fi
if has gdn; then
  # SIGINT at the limit: the benchmark writes the tables of what it measured so far
  timeout -s INT "$bench_seconds" python3 benchmarks/gdn_kernels.py --T 16384 32768 65536 8192 --no-breakdown \
    --out "$out/gdn_kernels.md" 2>&1 | tee "$out/bench.log"
  # fla-core autotunes again in this process: give it minutes
  timeout 300 python3 benchmarks/gdn_accuracy.py --T 4096 --seeds 1 2 --out "$out/gdn_accuracy.md" 2>&1 | grep "^|"
fi
if has packed; then
  timeout 600 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels -k "query_positions or packed" -s \
    2>&1 | tee "$out/packed_tests.log" | grep -E "vs |errors|passed|failed|Error"
  timeout 400 python3 benchmarks/local_attention.py --seq 32768 --kernels cudnn --documents 1024 4096 16384 \
    --out "$out/local_attention_packed.md" 2>&1 | grep "^|"
fi
if has order; then
  timeout 300 python3 benchmarks/overlap_timeline.py --methods all_gather ulysses hybrid --seq 8192 \
    --dump-dir /tmp/overlap_timeline --out "$out/overlap_timeline.md" 2>&1 | grep "^|"
  for rank in 0 1 2; do  # the first, a middle and the last rank of three
    timeout 200 python3 benchmarks/gdn_p2p_timeline.py --T 16384 --rank "$rank" --dump-dir /tmp/gdn_p2p_timeline \
      --out "$out/gdn_p2p_timeline_rank$rank.md" 2>&1 | grep -E "^\||^\*\*"
  done
fi
if has trainer; then
  what=${TRAINER:-vs_hf}
  # one GPU test file of tests/kernels under a limit: its log in $out/LOG.log, its verdict lines shown
  kernel_test() { timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider "tests/kernels/$2.py" --tb=short -s \
    2>&1 | tee "$out/$3.log" | grep -E "passed|failed|^E |^$4" | head -40; }
  # the eager 32K step against transformers + fla-core + cut-cross-entropy, each with a profiled step:
  # TIMEOUT WARMUP MAX_SECONDS (a method) TOTAL_SECONDS
  eager_vs_peer() { timeout "$1" python3 benchmarks/trainer_vs_hf.py --methods cpcompile,hf_fused_ce --seq-lens 32K \
    --max-seq-len 32K --compile-backend eager --warmup "$2" --repeat 3 --max-seconds "$3" --profile --total-seconds "$4" \
    --out "$out/eager_vs_hf_32k.md" 2>&1 | tee "$out/eager_vs_hf.log" | grep -E "^\| (cpcompile|hf)|^[0-9]+K"; }
  # issue 52's rows (HF_ROWS, default TRL's SFTTrainer beside cpcompile's trainer): TIMEOUT MAX_SECONDS
  hf_rows() { PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$1" python3 benchmarks/hf_trainer_gpu.py \
    --max-seconds "$2" --rows "${HF_ROWS:-sft_trainer,cpcompile_trainer}" --out "$out/hf_trainer_gpu.md" 2>&1 \
    | tee "$out/hf.log" | grep -E "^\||Error"; }
  # EXTRA: trainer flags, e.g. "--methods cpcompile --seq-lens 32K,128K --sdpa-backend cudnn"
  [ "$what" = vs_hf ] && timeout 590 python3 benchmarks/trainer_vs_hf.py ${EXTRA:-} --out "$out/trainer_vs_hf.md" \
    2>&1 | tee "$out/trainer_vs_hf.log" | grep -E "^\||longest"
  [ "$what" = load ] && timeout 590 python3 benchmarks/load_memory_gpu.py --out "$out/load_memory_gpu.md" \
    2>&1 | tee "$out/load_memory_gpu.log" | grep "^|"
  # WARMUP=1 saves a step a row (the bytes then counted in the measured step); RANKS=first|last|ends
  [ "$what" = simulate ] && timeout 590 python3 benchmarks/trainer_gpu.py --simulate-cp "${CP_SIZES:-2,4}" \
    --tokens "${TOKENS:-128K,256K}" --sdpa "${SDPA:-all_gather}" --warmup "${WARMUP:-2}" --ranks "${RANKS:-ends}" \
    --max-seconds 570 2>&1 | tee "$out/simulate.log" | grep "^|"
  # does 512K fit, for one method (METHOD=cpcompile|hf_fused_ce; ~4-6 min each; for the trainer's lower-memory
  # switches EXTRA="--gdn-checkpoint-around-core --offload-layer-inputs --compile-backend eager" LENGTHS=1M
  # WARMUP=0: one step, ~5-6 min at 1M): the longest-length question of trainer_vs_hf.py without its doubling
  # from 32K (the 32K-128K rows are in its results)
  [ "$what" = longest ] && timeout 590 python3 benchmarks/trainer_vs_hf.py --methods "${METHOD:-hf_fused_ce}" \
    --seq-lens "${LENGTHS:-512K}" --warmup "${WARMUP:-2}" --repeat 1 --max-seconds 575 --total-seconds 580 ${EXTRA:-} \
    --out "$out/longest_${METHOD:-hf_fused_ce}.md" 2>&1 | tee "$out/longest.log" | grep -E "^\||longest"
  # the model's own attention on cuDNN (train.sdpa_backend) against PyTorch's pick, the trainer alone at 32K and
  # 128K (~3 min each; rows past a run's 200 s say so), then cuDNN's bf16 parity against float32 at 8K
  # (train.verify: unrewritten bf16 and fp32 copies); 580 s at most
  if [ "$what" = attention ]; then
    for backend in pytorch cudnn; do
      flag=$([ "$backend" = cudnn ] && echo "--sdpa-backend cudnn")
      timeout 215 python3 benchmarks/trainer_vs_hf.py --methods cpcompile --seq-lens 32K,128K --max-seq-len 128K \
        --warmup 3 --repeat 3 --max-seconds 200 --total-seconds 200 $flag --out "$out/attention_$backend.md" \
        2>&1 | tee "$out/attention_$backend.log" | grep -E "^cpcompile"
    done
    timeout 150 python3 benchmarks/trainer_gpu.py --seq-len 8192 --steps 4 --verify --sdpa-backend cudnn \
      2>&1 | tee "$out/attention_verify.log" | grep -E "^step|^\|"
  fi
  # the 32K step against the fused-loss peer in one run, then where its time goes (the profiler
  # around the last step), then the GPU tests of the compiled conv taps and the compiled loss chunk
  # work (bf16 judged against float32); ~7 min; needs fla-core and cut-cross-entropy installed
  if [ "$what" = step32k ]; then
    timeout 330 python3 benchmarks/trainer_vs_hf.py --methods cpcompile,hf_fused_ce --seq-lens 32K --max-seq-len 32K \
      --warmup 3 --repeat 3 --max-seconds 160 --total-seconds 320 --out "$out/trainer_vs_hf_32k.md" \
      2>&1 | tee "$out/trainer_vs_hf_32k.log" | grep -E "^\||^[0-9]+K"
    timeout 150 python3 benchmarks/trainer_gpu.py --seq-len 32768 --steps 5 --profile > "$out/profile.log" 2>&1
    grep -E "^step|^\|" "$out/profile.log" | tail -5
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_linear_cross_entropy.py \
      tests/gdn/test_gdn_adapter.py 2>&1 | tail -3
  fi
  # compiled layers holding CP regions on CUDA (fake process group: runs and memory, not equivalence),
  # rank 0 profiled beside cp 1's compiled 32K step: why compiling gains 1.04x under CP and 1.84x
  # without (results/compiled_cp_2026-12-04_NVIDIA-H200.md); ~4 min
  if [ "$what" = compiled_cp ]; then
    timeout 300 python3 benchmarks/trainer_gpu.py --simulate-cp 2 --tokens 64K --sdpa all_gather \
      --compile-backend inductor --ranks first --warmup 2 --steps 1 --profile --max-seconds 280 \
      2>&1 | tee "$out/compiled_cp.log" | grep "^|"
    timeout 250 python3 benchmarks/trainer_gpu.py --seq-len 32768 --steps 5 --profile > "$out/cp1_profile.log" 2>&1
    grep -E "^step|^\|" "$out/cp1_profile.log" | tail -3
  fi
  # what issue 48 still lacks, in one call (~9 min, each row cut at the shared deadline): the padded
  # step (10% right padding, tokens/s in real tokens) beside the unpadded one, CP=2's last rank
  # compiled and eager, and the HF Trainer row of issue 52 (hf_trainer_gpu.py)
  if [ "$what" = remaining ]; then
    end=$((SECONDS + 570)); left() { echo $((end - SECONDS - $1)); }
    for pad in 0 0.1; do
      timeout "$(left 420)" python3 benchmarks/trainer_gpu.py --seq-len 32768 --steps 5 --pad-fraction $pad \
        2>&1 | tee "$out/padded_$pad.log" | grep -E "^\|" | tail -1
    done
    for backend in inductor eager; do
      timeout "$(left 180)" python3 benchmarks/trainer_gpu.py --simulate-cp 2 --tokens 64K --sdpa all_gather \
        --compile-backend $backend --ranks last --warmup 2 --steps 2 --max-seconds "$(left 185)" \
        2>&1 | tee "$out/last_rank_$backend.log" | grep "^|" | tail -1
    done
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$(left 5)" python3 benchmarks/hf_trainer_gpu.py \
      --max-seconds "$(left 10)" --out "$out/hf_trainer_gpu.md" 2>&1 | tee "$out/hf.log" | grep "^|"
  fi
  # what the session of 2026-12-06 (third) built without device time, in two calls of ~9 min each:
  # pending_a: the GPU tests of the changed paths (the cp 1 attention path and the loss's Triton chunk
  # kernels in bf16 against float64, the Triton GDN conv), the HF Trainer row of issue 52, and the eager
  # 32K step against transformers + fla-core + cut-cross-entropy (issue 48 item 5), profiled;
  # pending_b: the Triton conv's tile sweep and timing (then set TRITON_CONV_ON_GPU in
  # kernels/gdn/conv.py if it passes and wins), masked vs unmasked local attention (item 3), packed
  # GDN against the unpacked core (item 4)
  if [ "$what" = pending_a ]; then
    end=$((SECONDS + 575)); left() { echo $((end - SECONDS - $1)); }
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_attention_without_cp_gpu.py \
      tests/train/test_linear_cross_entropy.py tests/kernels/test_gdn_conv_triton.py --tb=short 2>&1 \
      | tee "$out/pending_tests.log" | grep -E "passed|failed|^E " | head -20
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$(left 300)" python3 benchmarks/hf_trainer_gpu.py \
      --max-seconds "$(left 305)" --out "$out/hf_trainer_gpu.md" 2>&1 | tee "$out/hf.log" | grep "^|"
    timeout "$(left 120)" python3 benchmarks/trainer_vs_hf.py --methods cpcompile,hf_fused_ce --seq-lens 32K \
      --max-seq-len 32K --compile-backend eager --warmup 3 --repeat 3 --max-seconds 100 --total-seconds 200 \
      --out "$out/eager_vs_hf_32k.md" 2>&1 | tee "$out/eager_vs_hf.log" | grep -E "^\||^[0-9]+K"
    timeout "$(left 5)" python3 benchmarks/trainer_gpu.py --seq-len 32768 --steps 4 --compile-backend eager \
      --profile > "$out/eager_profile.log" 2>&1; grep -E "^step|^\|" "$out/eager_profile.log" | head -25
  fi
  # pending_c: why CP=2's last rank gains 1.48x from compiling where rank 0 gains 2.0x: both profiled,
  # compiled (its eager step beside it, as in `remaining`); ~6 min
  if [ "$what" = pending_c ]; then
    for rank in last first; do
      timeout 270 python3 benchmarks/trainer_gpu.py --simulate-cp 2 --tokens 64K --sdpa all_gather \
        --compile-backend inductor --ranks $rank --warmup 2 --steps 1 --profile --max-seconds 260 \
        2>&1 | tee "$out/compiled_${rank}_profile.log" | grep "^|" | head -30
    done
  fi
  # next: what the fifth session of 2026-12-06 built without a GPU, in one call (~8 min): the HF Trainer
  # row with the integration's compiled layers and chunked loss (issue 52, both rows), then the eager 32K
  # step against transformers + fla-core + cut-cross-entropy (issue 48 item 5). Needs the peer's wheel:
  # `pip download --no-deps -d .whl cut-cross-entropy` here, then run with carry [".whl"]
  if [ "$what" = next ]; then
    end=$((SECONDS + 570)); left() { echo $((end - SECONDS - $1)); }
    ls .whl/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/cut_cross_entropy-*.whl
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$(left 200)" python3 benchmarks/hf_trainer_gpu.py \
      --max-seconds "$(left 205)" --out "$out/hf_trainer_gpu.md" 2>&1 | tee "$out/hf.log" | grep "^|"
    timeout "$(left 5)" python3 benchmarks/trainer_vs_hf.py --methods cpcompile,hf_fused_ce --seq-lens 32K \
      --max-seq-len 32K --compile-backend eager --warmup 3 --repeat 3 --max-seconds 90 --total-seconds 190 \
      --out "$out/eager_vs_hf_32k.md" 2>&1 | tee "$out/eager_vs_hf.log" | grep -E "^\||^[0-9]+K"
  fi
  # sixth_a / sixth_b: the sixth session of 2026-12-06, two calls of ~9.5 min. a: the HF Trainer row with
  # the integration's compiled layers and chunked loss (issue 52, both rows), then the GPU tests of what
  # was proven on CPU only: the masked attention on flash's varlen kernel, the one-block attention path,
  # the q/k cast in the Triton GDN core (bf16 against float64 / float32). b: the eager 32K step against transformers + fla-core + cut-cross-entropy
  # (issue 48 item 5; needs carry [".whl"]), then the masked local attention on flash's varlen kernel
  # against FlexAttention and unmasked cuDNN (item 3), then the padded 32K step beside the unpadded one
  if [ "$what" = sixth_a ]; then
    end=$((SECONDS + 580)); left() { echo $((end - SECONDS - $1)); }
    timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_varlen_attention.py \
      tests/kernels/test_local_attention.py tests/train/test_attention_without_cp_gpu.py tests/sdpa/test_sdpa_cuda_layout.py \
      --tb=short -s 2>&1 | tee "$out/sixth_tests.log" | grep -E "passed|failed|^E |^varlen" | head -30
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$(left 130)" python3 benchmarks/hf_trainer_gpu.py \
      --max-seconds "$(left 135)" --out "$out/hf_trainer_gpu.md" 2>&1 | tee "$out/hf.log" | grep "^|"
    timeout -s INT "$(left 60)" python3 benchmarks/masked_attention.py --seq 32768 --kernels local_attention \
      --out "$out/masked_attention.md" > "$out/masked.log" 2>&1; grep -E "^\||^- " "$out/masked.log" | head -30
    timeout "$(left 2)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gdn_triton.py \
      tests/gdn/test_gdn_adapter.py --tb=short 2>&1 | tee "$out/gdn_tests.log" | grep -E "passed|failed|^E " | head
  fi
  # sixth_c: after sixth_a's answers (the varlen test judged padding rows it should not have; GDN heads of
  # 16/32 gave NaN; the HF row's compiled layers failed under the Trainer's checkpoint): the fixed tests,
  # varlen in a model (head size 256), the refusal of small GDN heads, then the HF row again (~8 min)
  if [ "$what" = sixth_c ]; then
    end=$((SECONDS + ${SECONDS_LEFT:-495})); left() { echo $((end - SECONDS - $1)); }
    timeout "${TEST_SECONDS:-90}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_varlen_attention.py \
      tests/train/test_attention_without_cp_gpu.py "tests/kernels/test_gdn_triton.py::test_gpu_fwd_bwd_head_dim_64_and_fp32" \
      --tb=short -s 2>&1 \
      | tee "$out/sixth_c_tests.log" | grep -E "passed|failed|^E |^varlen" | head -30
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$(left 2)" python3 benchmarks/hf_trainer_gpu.py \
      --max-seconds "$(left 5)" --rows "${HF_ROWS:-hf_trainer,cpcompile_trainer}" --out "$out/hf_trainer_gpu.md" \
      2>&1 | tee "$out/hf.log" | grep -E "^\||Error"
  fi
  if [ "$what" = sixth_b ]; then
    end=$((SECONDS + 575)); left() { echo $((end - SECONDS - $1)); }
    ls .whl/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/cut_cross_entropy-*.whl
    timeout 260 python3 benchmarks/trainer_vs_hf.py --methods cpcompile,hf_fused_ce --seq-lens 32K \
      --max-seq-len 32K --compile-backend eager --warmup 3 --repeat 3 --max-seconds 110 --total-seconds 240 \
      --out "$out/eager_vs_hf_32k.md" 2>&1 | tee "$out/eager_vs_hf.log" | grep -E "^\||^[0-9]+K"
    timeout -s INT 150 python3 benchmarks/masked_attention.py --seq 32768 131072 --kernels local_attention \
      --out "$out/masked_attention.md" > "$out/masked.log" 2>&1; grep -E "^\||^- " "$out/masked.log" | head -40
    for pad in 0 0.1; do
      timeout "$(left 5)" python3 benchmarks/trainer_gpu.py --seq-len 32768 --steps 4 --pad-fraction $pad \
        2>&1 | tee "$out/padded_$pad.log" | grep -E "^\|" | tail -1
    done
  fi
  # seventh_a (2026-12-07, up to ~9.5 min; carry [".whl"] with the wheels of cut-cross-entropy and fla-core
  # 0.6.0: the lent machines have neither, and without fla-core the peer runs transformers' PyTorch GDN
  # reference, too slow to time): issue 48 item 5.
  # The eager CUDA GDN layer with its q/k norm in the core, bf16 against fp32; one eager GDN layer three
  # ways (norm stated in fp32, in the core, transformers' on fla-core); the eager 32K step against
  # transformers + fla-core + cut-cross-entropy with each one's profiled step; then the varlen GPU test
  # judged on keys no real query reads (sixth_c's run counted one-token documents' keys among them)
  if [ "$what" = seventh_a ]; then
    end=$((SECONDS + ${SECONDS_LEFT:-585})); left() { echo $((end - SECONDS - $1)); }
    python3 -m pip install -q --no-deps .whl/cut_cross_entropy-*.whl .whl/fla_core-*.whl
    # 120 s: the reference is now the eager fp32 core (the 2026-12-07 H200 call gave 75 s to fp32 Triton builds and logged nothing)
    kernel_test 120 test_gdn_normalising_core normalising_core normalising
    timeout 90 python3 benchmarks/gdn_eager_layer.py --T 32768 --out "$out/gdn_eager_layer.md" 2>&1 \
      | tee "$out/gdn_eager_layer.log" | grep -E "^\||Error"
    eager_vs_peer "$(($(left 80) < 300 ? $(left 80) : 300))" 3 140 "$(($(left 95) < 285 ? $(left 95) : 285))"
    kernel_test "$(left 2)" test_varlen_attention varlen_tests varlen
  fi
  # seventh_b (~9.5 min; carry [".whl"] with the wheels of trl 1.16, datasets 5.2, dill and multiprocess for
  # Python 3.12: `pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl trl==1.16.0
  # datasets==5.2.0 "dill<0.4.2" "multiprocess<0.70.20"`): issue 52's row of examples/hf_trainer_sft.py's
  # class, TRL's SFTTrainer (its own loss), beside cpcompile's trainer; then the packed chat fine-tune,
  # whose documents now run on varlen at head size 256 (what SECONDS_LEFT allows)
  if [ "$what" = seventh_b ]; then
    end=$((SECONDS + ${SECONDS_LEFT:-585})); left() { echo $((end - SECONDS - $1)); }
    python3 -m pip install -q --no-deps .whl/trl-*.whl .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl
    hf_rows "$(left 150)" "$(left 155)"
    timeout "$(left 2)" python3 benchmarks/finetune_gpu.py --steps 6 --out "$out/finetune_gpu.md" \
      2>&1 | tee "$out/finetune.log" | grep -E "^\||^step|Error" | tail -12
  fi
  # seventh_c (one call for both issues when only one machine comes; carry [".whl"] with every wheel of
  # seventh_a and seventh_b): the normalising core's GPU test, the eager layer three ways, the eager 32K
  # step against the peer with profiles, then with what is left the SFT row beside cpcompile's trainer
  # and the varlen test
  if [ "$what" = seventh_c ]; then
    end=$((SECONDS + ${SECONDS_LEFT:-585})); left() { echo $((end - SECONDS - $1)); }
    python3 -m pip install -q --no-deps .whl/*.whl
    kernel_test 75 test_gdn_normalising_core normalising_core normalising
    timeout 60 python3 benchmarks/gdn_eager_layer.py --T 32768 --repeat 10 --out "$out/gdn_eager_layer.md" 2>&1 \
      | tee "$out/gdn_eager_layer.log" | grep -E "^\||Error"
    eager_vs_peer "$(($(left 2) < 210 ? $(left 2) : 210))" 2 100 "$(($(left 10) < 200 ? $(left 10) : 200))"
    [ "$(left 0)" -gt 120 ] && hf_rows "$(left 20)" "$(left 25)"
    [ "$(left 0)" -gt 40 ] && kernel_test "$(left 2)" test_varlen_attention varlen_tests varlen
  fi
  # eighth (2026-12-07, one call for both issues when starts keep failing; carry [".whl"] with every
  # wheel of seventh_a and seventh_b): the SFT row beside cpcompile's trainer first (issue 52's one
  # missing number), then the normalising core's GPU test (its reference now the eager fp32 core),
  # then the eager 32K step against the peer with profiles, then the varlen test, each with what is left
  if [ "$what" = eighth ]; then
    end=$((SECONDS + ${SECONDS_LEFT:-560})); left() { echo $((end - SECONDS - $1)); }
    python3 -m pip install -q --no-deps .whl/*.whl
    hf_rows 250 245
    kernel_test "$(($(left 2) < 120 ? $(left 2) : 120))" test_gdn_normalising_core normalising_core normalising
    [ "$(left 0)" -gt 60 ] && eager_vs_peer "$(left 2)" 2 120 "$(left 8)"
    [ "$(left 0)" -gt 40 ] && kernel_test "$(left 2)" test_varlen_attention varlen_tests varlen
  fi
  if [ "$what" = pending_b ]; then
    end=$((SECONDS + 575)); left() { echo $((end - SECONDS - $1)); }
    timeout 150 python3 benchmarks/gdn_conv.py --tune --T 32768 2>&1 | tee "$out/gdn_conv_tune.log" | grep "^|"
    timeout 120 python3 benchmarks/gdn_conv.py --out "$out/gdn_conv.md" 2>&1 | grep "^|"
    timeout -s INT "$(left 160)" python3 benchmarks/masked_attention.py --seq 8192 32768 131072 \
      --out "$out/masked_attention.md" > "$out/masked.log" 2>&1; grep "^|" "$out/masked.log" | head -60
    timeout -s INT "$(left 5)" python3 benchmarks/gdn_documents.py --families core_op layer \
      --out "$out/gdn_documents.md" 2>&1 | tee "$out/gdn_documents.log" | grep "^|"
  fi
fi
if has multi && [ "$gpus" -ge 2 ]; then
  timeout 900 torchrun --standalone --nproc-per-node "$gpus" benchmarks/cp_methods.py --device cuda \
    --out "$out/cp_methods.md" 2>&1 | tee "$out/cp_methods.log" | grep "^|"
  timeout 900 torchrun --standalone --nproc-per-node "$gpus" benchmarks/sdpa_vs_torch_cp.py --device cuda \
    --out "$out/sdpa_vs_torch_cp.md" 2>&1 | tee "$out/sdpa_vs_torch_cp.log" | grep "^|"
  timeout 600 torchrun --standalone --nproc-per-node "$gpus" benchmarks/overlap_report.py --device cuda \
    --methods all_gather ulysses --seq 65536 --dump-dir /tmp/overlap --out "$out/overlap.md" 2>&1 | grep "^|"
fi
