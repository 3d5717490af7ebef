"""`make gpu-check`: one command that proves Baton on one GPU within a budget (480 s by
default) and brings back what it saw, in at most 8 files under OUT.

Five phases, one after another, each in a process group of its own with its own deadline
(benchmarks/gpu_check/runner.py), so a hang or a crash costs that phase only and is
reported as such (benchmarks/gpu_check/phases.py says what each runs):

  1 environment  GPU, driver, memory; torch, CUDA, NCCL, Triton, transformers versions; every
                 module of Baton (its tests and benchmarks too) imported, failures named
  2 kernels      the Triton kernels against torch: paged attention (decode, chunks, mixed,
                 split-KV), RoPE + KV store, add + RMSNorm; bf16, fp16, fp32
  3 engine       greedy parity with transformers in fp32 with CUDA graphs + overlapped
                 scheduling and eagerly, recompute and swap preemption, one device wait a step
  4 handoff      CUDA IPC between two processes, bitwise and checksummed, either peer killed
                 mid-transfer; `baton up --device cuda` disaggregated over ipc, streaming text
  5 figures      copy bandwidth, batch-1 decode against the weights' read time, graphs against
                 eager, the GPU's idle share at batch 64, offline throughput against
                 transformers and Baton static, disaggregated against colocated on one GPU

OUT gets summary.json (rewritten after every phase; on a GPU, nvidia-smi's samples in it),
summary.txt (the one-screen table of every check: PASS / FAIL / TIMEOUT / SKIP, its figure
and target) and a log per phase. `make gpu-check DEVICE=cpu` runs every phase on CPU with a tiny model and the
kernels under Triton's interpreter (CI does, with a phase made to hang: BATON_GPU_CHECK_HANG, under
a short deadline of its own: --deadline-s).
"""
