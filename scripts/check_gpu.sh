#!/usr/bin/env bash
# Check the CUDA path on a machine with one GPU, in well under five minutes. Installs nothing: it uses the
# Python that already has multigpu and torch (./.venv when present, else $PYTHON or python3).
# Prints one PASS/FAIL line per check; writes every check's full log to $OUT (or ./gpu_check_logs).
# Exit code: 0 when every check passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [[ -x .venv/bin/python ]]; then PY=${PYTHON:-$ROOT/.venv/bin/python}; else PY=${PYTHON:-python3}; fi
LOGS=${OUT:-$ROOT/gpu_check_logs}
mkdir -p "$LOGS"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
failed=0

check() {  # check NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    if (cd "$WORK" && timeout --kill-after=10 "$limit" "$@") >"$LOGS/$name.log" 2>&1; then
        echo "PASS $name ($((SECONDS - start))s)"
    else
        echo "FAIL $name (exit $?, $((SECONDS - start))s; log: $LOGS/$name.log)"
        tail -n 15 "$LOGS/$name.log" | sed 's/^/    /'
        failed=1
    fi
}

{
    echo "python: $PY"
    "$PY" -c 'import torch, multigpu; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), "| multigpu", multigpu.__version__)'
    command -v nvidia-smi >/dev/null && nvidia-smi -L
} >"$LOGS/environment.log" 2>&1
head -n 3 "$LOGS/environment.log"

cat >"$WORK/nccl_all_reduce.py" <<'PY'
import os
import torch
import torch.distributed as dist
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
torch.cuda.synchronize()
w = dist.get_world_size()
assert t.tolist() == [w * (w + 1) / 2] * 4, t
print(f"nccl all_reduce ok: rank {dist.get_rank()} of {w}, backend {dist.get_backend()}, "
      f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}, {torch.cuda.get_device_name()}")
dist.destroy_process_group()
PY

check devices 30 bash -c "'$PY' -m multigpu devices | tee /dev/stderr | grep -Eq '^0: '"
check nccl_1rank 120 bash -c "'$PY' -m multigpu run --gpus 0 --status off --output '$WORK/run' \
    '$WORK/nccl_all_reduce.py' && grep -q 'nccl all_reduce ok: rank 0 of 1, backend nccl' \
    '$WORK/run/logs/attempt_0/rank_0.log'"
check demo_1gpu 150 bash -c "'$PY' -m multigpu demo --gpus 0 --steps 100 >'$WORK/demo.out' 2>&1; rc=\$?; \
    cat '$WORK/demo.out'; [ \$rc = 0 ] && grep -q '1 rank(s) on cuda' '$WORK/demo.out' \
    && grep -q '^done: loss' '$WORK/demo.out'"
# Function mode on NCCL: rank 1 raises while rank 0 waits in NCCL collectives, in torch.cuda.synchronize()
# behind one, and in time.sleep(30); rank 0 must get WorkerFailedError within 5 s (each log has the latency).
# NCCL refuses two ranks on one GPU, so this needs two.
ngpus=$("$PY" -c 'from multigpu.cluster.devices import visible_gpus; print(len(visible_gpus()))' 2>/dev/null || echo 0)
if [[ $ngpus -ge 2 ]]; then
    for case in collective synchronize sleep; do
        check "manager_nccl_$case" 90 "$PY" "$ROOT/tests/gpu/manager_nccl_failure.py" "$case" "$WORK/mgr_$case"
        grep -h '^CAUGHT' "$LOGS/manager_nccl_$case.log" | sed "s/^/    $case: /"
    done
else
    echo "SKIP manager_nccl_* (function mode on NCCL needs 2 GPUs; $ngpus visible)"
fi
# The warm worker template (H4) on CUDA: ranks forked from a template that imported torch (never CUDA)
# initialise CUDA and NCCL themselves; a restart forks again from the same template.
cat >"$WORK/template_restart.py" <<'PY'
import os, sys, torch, torch.distributed as dist
forked = "torch" in sys.modules
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"template rank {dist.get_rank()} attempt {attempt} forked={forked} sum={int(t[0].item())}", flush=True)
if attempt == 0:
    os._exit(3)
dist.destroy_process_group()
PY
check template_nccl_restart 150 bash -c "'$PY' -m multigpu run --gpus 0 --status off --max-restarts 1 \
    --output '$WORK/tpl' '$WORK/template_restart.py' && grep -q 'attempt 1 forked=True sum=1' \
    '$WORK/tpl/logs/attempt_1/rank_0.log'"
# Every GPU test skipping (no GPU seen, a broken driver) is a failure here, not a pass: at least one must pass.
check pytest_gpu 240 bash -c "'$PY' -m pytest -q -rs -p no:cacheprovider '$ROOT/tests/gpu' >'$WORK/pytest_gpu.out' 2>&1; \
    rc=\$?; cat '$WORK/pytest_gpu.out'; [ \$rc = 0 ] && tail -n 1 '$WORK/pytest_gpu.out' | grep -Eq '[0-9]+ passed' \
    || { echo 'no GPU test passed (exit '\$rc'; all skipped?)'; exit 1; }"
# Preemption on NCCL: SIGUSR1 reaches a rank inside NCCL work; it is recorded, the loop stops via
# multigpu.should_stop, saves, and the launcher exits 75 (no SLURM here: nothing to requeue).
check preempt_nccl 150 bash -c "'$PY' -m multigpu run --gpus 0 --status off --preempt-signal USR1 \
    --output '$WORK/preempt' '$ROOT/examples/preemptible.py' --warn-at 5; [ \$? = 75 ] \
    && grep -q 'stopped for preemption at step' '$WORK/preempt/logs/attempt_0/rank_0.log'"
cp -r "$WORK/run" "$LOGS/nccl_run" 2>/dev/null || true

# Hangs (issue 14): a NCCL rank stops reporting steps; the learned timeout stops the run, the flight
# recorder (on by default for GPU ranks) is dumped into the run folder and read into the report.
cat >"$WORK/nccl_hang.py" <<'PY'
import os, time
import torch
import torch.distributed as dist
import multigpu
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
t = torch.ones(1024, device="cuda")
for step in range(1, 1000):
    with multigpu.section("forward"):
        if step == 20:
            time.sleep(600)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    multigpu.heartbeat(step=step)
PY
cat >"$WORK/read_fr.py" <<'PY'
import sys
from multigpu.supervisor.hangs.flight_record import read_dumps
dumps = read_dumps(sys.argv[1])
ops = {e["profiling_name"] for e in dumps[0]["entries"]}
print("flight record:", len(dumps[0]["entries"]), "entries", sorted(ops))
assert "nccl:all_reduce" in ops, ops
PY
check nccl_hang_flight_recorder 120 bash -c "'$PY' -m multigpu run --gpus 0 --status off --grace-period 2 \
    --hang-timeout 100 --hang-floor 3 --output '$WORK/hang' '$WORK/nccl_hang.py'; [ \$? = 1 ] \
    && '$PY' '$WORK/read_fr.py' '$WORK/hang/logs/attempt_0/fr_trace_rank_'"
grep -h -m1 'attempt 0 hung' "$LOGS/nccl_hang_flight_recorder.log" | cut -c1-300 | sed 's/^/    /'
grep -h 'flight record:' "$LOGS/nccl_hang_flight_recorder.log" | sed 's/^/    /'

# multigpu.launch (issue 33) from a caller that has initialised CUDA and runs a thread, as a notebook
# kernel may: the ranks fork from the template, never from the caller; a rank's CUDA tensor comes back
# on the CPU; the default nprocs is every visible GPU.
cat >"$WORK/launch_after_cuda.py" <<'PY'
import os, threading, time
import torch
import multigpu
held = torch.ones(1, device="cuda")  # the caller's own CUDA context, as a notebook's
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()

def on_gpu():
    import torch
    return torch.full((2,), float(os.environ["RANK"]) + 1, device="cuda")

values = multigpu.launch(on_gpu)
assert len(values) == torch.cuda.device_count(), values
assert all(v.device.type == "cpu" for v in values), values
assert values[0].tolist() == [1.0, 1.0], values
print(f"launch after CUDA ok: {len(values)} rank(s), values on the CPU")
PY
check launch_after_cuda 120 bash -c "'$PY' '$WORK/launch_after_cuda.py' | tee /dev/stderr | grep -q 'launch after CUDA ok'"

# --preflight on a GPU (issue 34): the check process on cuda:0, a matmul on the GPU and an NCCL group
# formed over a c10d store through its prefix (one node: NCCL refuses two ranks on one GPU), as a
# template-less node runs it (python -m multigpu.preflight).
cat >"$WORK/preflight_gpu.py" <<'PY'
import os, subprocess, sys
from datetime import timedelta
from torch.distributed import TCPStore
from multigpu.contract.preflight_wire import PreflightResult, PreflightTask
store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
task = PreflightTask("127.0.0.1", store.port, "multigpu/gpu/preflight/0/", 0, 1, "cuda:0", 60.0, os.getpid())
done = subprocess.run([sys.executable, "-m", "multigpu.preflight", task.encode()], capture_output=True,
                      text=True, timeout=150)
assert done.returncode == 0, done.stderr
[figures] = PreflightResult.decode(done.stdout).figures
gflops, gbps = figures.matmul_gflops, figures.all_reduce_gbps
assert gflops > 1000 and gbps > 0, (gflops, gbps)
print(f"preflight on cuda:0 ok: matmul {gflops:.0f} GFLOP/s, nccl all_reduce {gbps:.2f} GB/s")
PY
check preflight_nccl 180 bash -c "'$PY' '$WORK/preflight_gpu.py' | tee /dev/stderr | grep -q 'preflight on cuda:0 ok'"
grep -h 'preflight on cuda:0 ok' "$LOGS/preflight_nccl.log" | sed 's/^/    /'

if [[ $failed == 0 ]]; then echo "PASS all GPU checks"; else echo "FAIL some GPU checks (logs in $LOGS)"; fi
exit $failed
