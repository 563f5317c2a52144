// The scheduler's device loop: graph launches, sleeps, the "done" kernel and the stand-in step, in CUDA C++.
//
// NVRTC compiles this file after C declarations of the records it reads (BlinkLaunch: the launch table), written
// from the numpy dtypes the Python side uses (blink/device/image.py: SHIM_STRUCTS), and with -D definitions of every
// constant below (SHIM_DEFINES), taken from the Python modules that own them, so the two sides cannot disagree. The
// iteration itself is numba code (blink_iterate), linked in by nvJitLink: its part PREPARE needs the finished step
// and writes the next one's inputs; its part SETTLE (publish; doorbells, collect) needs nothing from the step and
// writes nothing it reads, so the resident loop runs it while the step runs (blink/device/scheduler.py).
#if !defined(WINDOW) || !defined(STOP) || !defined(AGAIN) || !defined(PREPARE) || !defined(SETTLE) ||              \
    !defined(WATCH) || !defined(ITERATION) || !defined(LAUNCH_RETRIES) || !defined(LAUNCH_RETRY_NS) ||               \
    !defined(DONE_POLL_NS) || !defined(WATCH_POLL_NS) || !defined(TABLE_WORDS)
#error "compile shim.cu through blink.device.image.compile_shim: it declares the records and defines the constants"
#endif

extern "C" __device__ int blink_iterate(long long *table, int part);

// clock64() for numba code (declared there with cuda.declare_device, numba's device-function ABI).
extern "C" __device__ int blink_clock(long long *cycles) {
  *cycles = clock64();
  return 0;
}

// Launch a graph from the device; retry briefly (a graph that just signalled may not have retired yet), then
// publish the error to the ring so the host and the agent can see it.
__device__ bool blink_launch(cudaGraphExec_t graph, cudaStream_t how, int *launch_error) {
  cudaError_t e = cudaGraphLaunch(graph, how);
  for (int tries = 0; e != cudaSuccess && tries < LAUNCH_RETRIES; tries++) {
    __nanosleep(LAUNCH_RETRY_NS);
    e = cudaGraphLaunch(graph, how);
  }
  if (e == cudaSuccess) return true;
  *(volatile int *)launch_error = (int)e;
  __threadfence_system();
  return false;
}

// The address table (blink/device/array_table.py: every array's address and shape, written once by the host) copied
// into shared memory where an execution starts, by the whole block; the iteration reads it there. Each fence of the
// iteration (blink_step's, publish's) invalidates L1 (CCTL.IVALL follows every MEMBAR in the SASS), so a table word
// read from global memory after one was an L2 round trip in front of the array's own load.
__device__ long long *blink_table_in_shared(const long long *table) {
  __shared__ long long words[TABLE_WORDS];
  for (int i = threadIdx.x; i < TABLE_WORDS; i += blockDim.x) words[i] = table[i];
  __syncthreads();
  return words;
}

// Parts of an iteration by the whole block; every thread's step inputs are visible device-wide when it returns.
__device__ int blink_step(long long *table, int parts) {
  int outcome = blink_iterate(table, parts);
  __threadfence();
  __syncthreads();
  return outcome;
}

// Launch mode "tail": one whole iteration per execution, then the step graph and this graph again, as tail launches.
extern "C" __global__ void blink_scheduler_tail(long long *table, BlinkLaunch *launch, int *launch_error,
                                                int idle_ns) {
  table = blink_table_in_shared(table);
  int outcome = blink_step(table, ITERATION);
  if (threadIdx.x != 0 || outcome == STOP) return;
  if (outcome >= 0) {
    if (!blink_launch((cudaGraphExec_t)launch->graphs[0][outcome], cudaStreamGraphTailLaunch, launch_error)) return;
  } else if (idle_ns > 0) {
    __nanosleep(idle_ns);
  }
  blink_launch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch, launch_error);
}

// Launch mode "fire_and_forget": stay resident for up to WINDOW step launches (a CUDA limit on fire-and-forget
// launches per graph execution): prepare, fire the step graph (two instantiations alternate: a graph cannot be
// relaunched before its previous launch retires), settle (publish, then collect) while it runs, wait for its done
// kernel, repeat; then tail-relaunch this graph. An iteration that had nothing to run and left no work is followed
// by a watch of the doorbells (blink_watch), still resident: a relaunch costs more than a look at them, and a
// request that arrives while the loop sleeps waits out the sleep. Thread 0 keeps the launch table's words it changes
// (the done count it waits past, the parity, the profile) in registers and stores them where the execution ends: a
// load of one between prepare and the launch, or after the wait, is a memory round trip on the step's path.
__device__ void blink_window_end(BlinkLaunch *launch, unsigned long long parity, long long cycles, long long timed) {
  launch->parity = parity;
  launch->step_cycles += cycles;                       // launch + step (settle overlaps it) + wake-up, for the profile
  launch->steps_timed += timed;
}

__device__ unsigned long long blink_globaltimer() {
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// Idle: read the doorbells (WATCH: nothing written) every WATCH_POLL_NS until one moves or idle_ns have passed (at
// least one look), so the next iteration starts within a round trip of a doorbell; it also beats the heartbeat at
// the idle sleep's pace, as a relaunch after the sleep did. Thread 0 keeps the time; the block follows its word.
// Not inlined: inlined into the loop (a WATCH specialisation of the iteration), it changed the code generated for
// the loop's settle (collect 0.11 us slower per step on an H100).
__device__ __noinline__ void blink_watch(long long *table, int idle_ns) {
  __shared__ int watching;
  unsigned long long until = 0;
  if (threadIdx.x == 0) until = blink_globaltimer() + (unsigned long long)idle_ns;
  while (blink_iterate(table, WATCH) != AGAIN) {
    if (threadIdx.x == 0) {
      __nanosleep(WATCH_POLL_NS);
      watching = blink_globaltimer() < until;
    }
    __syncthreads();                                   // also: every thread has read WATCH's answer before the next
    if (!watching) return;                             // look zeroes it
  }
}

extern "C" __global__ void blink_scheduler_window(long long *table, BlinkLaunch *launch, int *launch_error,
                                                  int idle_ns) {
  __shared__ int go;
  volatile unsigned long long *done = &launch->done;
  unsigned long long seen = 0, parity = 0;             // thread 0's: the done count and the parity
  long long cycles = 0, timed = 0;
  if (threadIdx.x == 0) {
    seen = *done;                                      // no step of ours runs between executions
    parity = launch->parity;
  }
  table = blink_table_in_shared(table);
  for (int launches = 0; launches < WINDOW;) {
    int outcome = blink_step(table, PREPARE);
    if (outcome == STOP) {
      if (threadIdx.x == 0) blink_window_end(launch, parity, cycles, timed);
      return;
    }
    long long start = 0;
    if (threadIdx.x == 0) {
      go = outcome;
      if (outcome >= 0) {
        start = clock64();
        if (!blink_launch((cudaGraphExec_t)launch->graphs[parity][outcome], cudaStreamGraphFireAndForget,
                          launch_error)) {
          go = STOP;
        }
        parity ^= 1ULL;
      }
    }
    launches += outcome >= 0;
    __syncthreads();
    if (go == STOP) {
      if (threadIdx.x == 0) blink_window_end(launch, parity, cycles, timed);
      return;
    }
    int settled = blink_iterate(table, SETTLE);       // the step runs meanwhile
    if (threadIdx.x == 0 && outcome >= 0) {
      unsigned long long now;
      while ((now = *done) == seen) __nanosleep(DONE_POLL_NS);
      seen = now;
      cycles += clock64() - start;
      timed += 1;
    }
    __syncthreads();
    if (outcome < 0 && settled != AGAIN) blink_watch(table, idle_ns);
  }
  if (threadIdx.x == 0) {
    blink_window_end(launch, parity, cycles, timed);
    blink_launch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch, launch_error);
  }
}

// The last kernel of every step graph: tells a resident scheduler that the step's results are in memory.
extern "C" __global__ void blink_done(BlinkLaunch *launch) {
  __threadfence();
  atomicAdd(&launch->done, 1ULL);
}

// The stand-in model step (blink/ring/standin.py: the same splitmix64 hash, the same token history), one thread per
// token row (recorded in the history, as a model step records it) and per sequence row (sampled).
__device__ unsigned long long blink_mix64(unsigned long long x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

extern "C" __global__ void blink_standin_step(const int *logits_indices, const int *token_ids, const int *positions,
                                              const long long *slot_mapping, const long long *seed, int *sampled_ids,
                                              float *sampled_logprobs, int *history_tokens, int tokens, int rows,
                                              int vocab) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < tokens && slot_mapping[r] >= 0) history_tokens[slot_mapping[r]] = token_ids[r];
  if (r >= rows) return;
  int t = logits_indices[r];
  if (t < 0) return;
  unsigned long long prev = (unsigned long long)token_ids[t], position = (unsigned long long)(positions[t] + 1);
  unsigned long long h = blink_mix64((unsigned long long)seed[r] ^ (prev * 0x9E3779B97F4A7C15ULL)
                                     ^ (position * 0xC2B2AE3D27D4EB4FULL));
  sampled_ids[r] = (int)(h % (unsigned long long)vocab);
  sampled_logprobs[r] = -(float)((h >> 32) % 4096ULL) / 256.0f;
}
