/*
 * megatrace NCCL profiler plugin.
 *
 * NCCL (>= 2.23) loads the shared library named by NCCL_PROFILER_PLUGIN and
 * looks for the exported symbol of the newest profiler interface it knows:
 * ncclProfiler_v7 (NCCL 2.31+), v6 (2.29), v5 (2.28) or v4 (2.27). All four are
 * provided here, written from NCCL's public interface description with our
 * own declarations (no NCCL headers are needed to build), so the newest one the
 * job's NCCL offers is the one it uses.
 *
 * What it does:
 *  - collectives and point-to-point calls: comm hash, rank, nranks, seq,
 *    func, count, datatype, algo, proto, channels; "enqueued" at the call's
 *    stop, started when its first kernel channel starts (the GPU reached the
 *    call: the host runs ahead of the GPU, so the enqueue time says little),
 *    completed at the last proxy-op or kernel-channel stop;
 *  - proxy operations summarised per (comm, seq, channel, peer, direction):
 *    steps posted and done, bytes, first/last timestamps, and the time spent
 *    in each proxy-step wait state (SendGPUWait, SendPeerWait, SendWait,
 *    RecvWait, RecvFlushWait, RecvGPUWait);
 *  - a proxy operation unfinished after MEGATRACE_STUCK_MS (500 ms) is
 *    reported as it stands (posted, not done: a network hang);
 *  - per-peer throughput samples: a send proxy operation's bytes over its time
 *    in SendWait (the network's share of the transfer);
 *  - liveness: every MEGATRACE_HEARTBEAT_MS (500 ms) one record per rank with
 *    each communicator's last issued and completed collective, so a hang is
 *    visible even when no call completes;
 *  - a call enqueued but unfinished after MEGATRACE_STUCK_MS is reported as
 *    joined and not finished;
 *  - a rank's transfers to itself are counted, not recorded: NCCL runs them
 *    with no proxy operation, so no event says when they end (seen with
 *    NCCL 2.28.9 by `megatrace gpu-check`);
 *  - v6: copy-engine collectives (CeColl) are collectives like the others, started
 *    at their start and finished at their stop; their CeSync/CeBatch parts are
 *    counted;
 *  - v7: the user's profiler tag and the kernel variant ride on the call; with
 *    MEGATRACE_KERNEL_PHASES=1 the kernel's phases (initial sync, data movement,
 *    final sync, GPU-timed, per channel) are asked for, and the longest of each
 *    over the call's channels is recorded: the GPU's own measure of how long it
 *    waited for its peers and of the transfer.
 *
 * Event mask: Coll, P2p, ProxyOp, ProxyStep and KernelCh (and CeColl from v6).
 * KernelCh events cost NCCL itself time on small collectives (NVIDIA/nccl#2355),
 * but they are what says when the GPU reached a call and when it finished it;
 * kernel phases add three events a channel and only symmetric kernels emit them,
 * so they are off unless asked for. `megatrace bench plugin` prints this plugin's
 * own cost per event.
 *
 * Hot path: events come from a fixed pool (no allocation), a proxy-step state
 * change is a clock read and two additions, finished records go into a
 * lock-free ring as binary structs. A background thread formats them as the
 * schema's JSON lines and sends them to the node agent's Unix datagram socket
 * (MEGATRACE_AGENT__SOCKET), many records per datagram, never blocking NCCL:
 * if the agent's queue is full that thread waits for room a little (see
 * mt_send); if the agent is absent, or stays full, records are dropped and
 * counted.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ interface */

typedef int mt_result_t; /* ncclResult_t: 0 is success */
typedef void (*mt_logger_t)(int level, unsigned long flags, const char *file, int line,
                            const char *fmt, ...);

enum {
  MT_GROUP = 1 << 0, MT_COLL = 1 << 1, MT_P2P = 1 << 2, MT_PROXY_OP = 1 << 3,
  MT_PROXY_STEP = 1 << 4, MT_PROXY_CTRL = 1 << 5, MT_KERNEL_CH = 1 << 6, MT_NET = 1 << 7,
  MT_CE_COLL = 1 << 12, MT_CE_SYNC = 1 << 13, MT_CE_BATCH = 1 << 14, MT_KERNEL_PHASE = 1 << 15,
};

enum { /* event states, numbered as NCCL numbers them */
  MT_STEP_SEND_GPU_WAIT = 8, MT_STEP_SEND_WAIT = 9, MT_STEP_RECV_WAIT = 10,
  MT_STEP_RECV_FLUSH_WAIT = 11, MT_STEP_RECV_GPU_WAIT = 12, MT_STEP_SEND_PEER_WAIT = 20,
  MT_KERNEL_CH_STOP = 22, MT_KERNEL_PHASE_STOP = 31,
};
#define MT_PHASES 3 /* initial sync, data movement, final sync */

struct mt_coll_descr { /* shared tail of the coll descriptor in v4 and v5 */
  uint64_t seqNumber;
  const char *func;
  void const *sendBuff;
  void *recvBuff;
  size_t count;
  int root;
  const char *datatype;
  uint8_t nChannels;
  uint8_t nWarps;
  const char *algo;
  const char *proto;
};
struct mt_p2p_descr { const char *func; void *buff; const char *datatype; size_t count; int peer; uint8_t nChannels; };
struct mt_proxy_op_descr { pid_t pid; uint8_t channelId; int peer; int nSteps; int chunkSize; int isSend; };
struct mt_kernel_ch_descr { uint8_t channelId; uint64_t pTimer; };

typedef struct {
  uint8_t type;
  void *parentObj;
  int rank;
  union {
    struct mt_coll_descr coll;
    struct mt_p2p_descr p2p;
    struct mt_proxy_op_descr proxyOp;
    struct { int step; } proxyStep;
    struct mt_kernel_ch_descr kernelCh;
    struct { int64_t id; void *data; } netPlugin;
  };
} mt_descr_v4;

typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {
    struct { int graphCaptured; int groupDepth; } groupApi;
    struct { const char *func; size_t count; const char *datatype; int root; void *stream; bool graphCaptured; } collApi;
    struct { const char *func; size_t count; const char *datatype; void *stream; bool graphCaptured; } p2pApi;
    struct { void *stream; } kernelLaunch;
    struct { struct mt_coll_descr d; void *parentGroup; } coll;
    struct { struct mt_p2p_descr d; void *parentGroup; } p2p;
    struct mt_proxy_op_descr proxyOp;
    struct { int step; } proxyStep;
    struct mt_kernel_ch_descr kernelCh;
    struct { int64_t id; void *data; } netPlugin;
  };
} mt_descr_v5;

struct mt_ce_coll_descr { /* v6 copy-engine collective (v7 adds the user's tag) */
  uint64_t seqNumber;
  const char *func;
  void const *sendBuff;
  void *recvBuff;
  size_t count;
  int root;
  const char *datatype;
  const char *syncStrategy;
  bool intraBatchSync;
  uint32_t batchSize, numBatches, ceSeqNum;
  void *stream;
};

typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {
    struct { int graphCaptured; int groupDepth; } groupApi;
    struct { const char *func; size_t count; const char *datatype; int root; void *stream; bool graphCaptured; } collApi;
    struct { const char *func; size_t count; const char *datatype; void *stream; bool graphCaptured; } p2pApi;
    struct { void *stream; } kernelLaunch;
    struct { struct mt_coll_descr d; void *parentGroup; } coll;
    struct { struct mt_p2p_descr d; void *parentGroup; } p2p;
    struct mt_proxy_op_descr proxyOp;
    struct { int step; } proxyStep;
    struct mt_kernel_ch_descr kernelCh;
    struct { int64_t id; void *data; } netPlugin;
    struct mt_ce_coll_descr ceColl;
    struct { bool isComplete; int nRanks; } ceCollSync;
    struct { int numOps; size_t totalBytes; bool useIntraSync; } ceCollBatch;
  };
} mt_descr_v6;

typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {
    struct { int graphCaptured; int groupDepth; } groupApi;
    struct { const char *func; size_t count; const char *datatype; int root; void *stream; bool graphCaptured; uint64_t userTag; } collApi;
    struct { const char *func; size_t count; const char *datatype; void *stream; bool graphCaptured; uint64_t userTag; } p2pApi;
    struct { void *stream; } kernelLaunch;
    struct { struct mt_coll_descr d; void *parentGroup; const char *kernelVariant; bool isSymColl; uint64_t userTag; } coll;
    struct { struct mt_p2p_descr d; void *parentGroup; uint64_t userTag; } p2p;
    struct mt_proxy_op_descr proxyOp;
    struct { int step; } proxyStep;
    struct mt_kernel_ch_descr kernelCh;
    struct { int64_t id; void *data; } netPlugin;
    struct { struct mt_ce_coll_descr d; uint64_t userTag; } ceColl;
    struct { bool isComplete; int nRanks; } ceCollSync;
    struct { int numOps; size_t totalBytes; bool useIntraSync; } ceCollBatch;
    struct { uint8_t channelId; uint8_t phaseId; const char *phaseName; uint64_t pTimer; } kernelPhase;
  };
} mt_descr_v7;

/* What a newer descriptor adds to a call, and its copy-engine or phase part. */
typedef struct {
  uint64_t user_tag;
  const char *variant;
  const struct mt_ce_coll_descr *ce;
  int phase_id;
  uint64_t phase_timer;
} mt_extra;

typedef union {
  struct { size_t transSize; } proxyStep;
  struct { int appendedProxyOps; } proxyCtrl;
  struct { void *data; } netPlugin;
  struct { uint64_t pTimer; } kernelCh;
} mt_state_args;

/* ------------------------------------------------------------------ state */

#define MT_POOL 65536
#define MT_RING 32768
#define MT_WAITS 6

typedef struct mt_ctx {
  uint64_t comm_hash;
  int rank, nranks, nnodes, global_rank;
  _Atomic uint64_t *p2p_seq; /* [2 * nranks]: next seq per (peer, direction) */
  _Atomic int64_t issued, completed; /* collective seq numbers, for liveness */
} mt_ctx;

#define MT_MAX_CTX 1024
static mt_ctx *g_ctxs[MT_MAX_CTX];
static pthread_mutex_t g_ctx_lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct mt_event {
  _Atomic int used;
  int kind;
  uint64_t pair_hash; /* p2p: a two-rank communicator per pair of comm ranks */
  mt_ctx *ctx;
  struct mt_event *parent;
  /* coll / p2p */
  uint64_t seq;
  const char *func, *dtype, *algo, *proto;
  size_t count;
  int peer, nchannels;
  int64_t t_enqueue, t_done;
  _Atomic int64_t t_start; /* the first kernel channel's start: the GPU reached the call */
  _Atomic int pending;
  _Atomic int children;
  _Atomic int kernels_done; /* kernel channels stopped: all nchannels means the kernel ended */
  _Atomic int stopped;
  /* proxy op */
  int channel, is_send, nsteps;
  int64_t first, last;
  _Atomic uint64_t bytes;
  _Atomic int steps_done;
  _Atomic int64_t wait[MT_WAITS];
  _Atomic int reported; /* proxy op or collective reported unfinished */
  /* proxy step */
  int state;
  int64_t state_t;
  /* v7: the call's tag and kernel variant; its kernel phases' longest durations */
  uint64_t user_tag;
  const char *variant;
  _Atomic int64_t phase[MT_PHASES];
  /* kernel phase: which, and its GPU start */
  int phase_id;
  uint64_t phase_timer;
} mt_event;

enum { REC_COLL = 1, REC_PROXY = 2, REC_HB = 3 };

typedef struct {
  _Atomic int ready;
  int kind;
  uint64_t comm_hash, seq;
  int global_rank, rank, nranks, peer, nchannels, channel, is_send, nsteps, steps_done;
  const char *func, *dtype, *algo, *proto;
  size_t count;
  uint64_t bytes;
  int64_t t_enqueue, t_start, t_done, first, last;
  int64_t wait[MT_WAITS];
  int64_t phase[MT_PHASES];
  uint64_t user_tag;
  const char *variant;
} mt_rec;

static mt_event g_pool[MT_POOL];
static _Atomic uint32_t g_pool_next;
static mt_rec g_ring[MT_RING];
static _Atomic uint64_t g_ring_head, g_ring_tail;
static _Atomic uint64_t g_dropped, g_events, g_sent;
/* Health counters, by what NCCL did: starts of Coll, P2p, ProxyOp, ProxyStep and
 * KernelCh events; KernelCh stops; children whose parent NCCL did not give; calls
 * finished; calls reported stuck; transfers to the rank itself (not tracked);
 * copy-engine collectives, their sync and batch parts; kernel phases. */
enum { C_COLL, C_P2P, C_PROXY_OP, C_PROXY_STEP, C_KERNEL_CH, C_KERNEL_CH_STOP, C_ORPHAN,
       C_FINISHED, C_STUCK, C_SELF, C_CE_COLL, C_CE_PART, C_KERNEL_PHASE, C_NCOUNTS };
static _Atomic uint64_t g_counts[C_NCOUNTS];
static inline void mt_count(int i) { atomic_fetch_add_explicit(&g_counts[i], 1, memory_order_relaxed); }
static _Atomic int g_refs;
static pthread_t g_flusher;
static _Atomic int g_stop;
static int g_sock = -1;
static struct sockaddr_un g_addr;
static char g_node[256], g_job[160];
static int64_t g_stuck_ns = 500000000LL;
static int64_t g_heartbeat_ns = 500000000LL;
static mt_logger_t g_log;

static inline uint64_t mt_mix(uint64_t x) { /* splitmix64 finaliser */
  x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27; x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

static inline int64_t mt_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static mt_event *mt_alloc(void) {
  for (int tries = 0; tries < 64; tries++) {
    uint32_t i = atomic_fetch_add_explicit(&g_pool_next, 1, memory_order_relaxed) % MT_POOL;
    int expected = 0;
    if (atomic_compare_exchange_strong(&g_pool[i].used, &expected, 1)) {
      mt_event *e = &g_pool[i];
      e->parent = NULL; e->ctx = NULL; e->func = e->dtype = e->algo = e->proto = NULL;
      e->t_enqueue = e->t_done = e->first = e->last = 0;
      e->user_tag = 0; e->variant = NULL; e->phase_id = -1; e->phase_timer = 0;
      for (int ph = 0; ph < MT_PHASES; ph++) atomic_store(&e->phase[ph], 0);
      atomic_store(&e->t_start, 0);
      atomic_store(&e->pending, 0); atomic_store(&e->children, 0); atomic_store(&e->stopped, 0);
      atomic_store(&e->kernels_done, 0);
      atomic_store(&e->bytes, 0); atomic_store(&e->steps_done, 0); atomic_store(&e->reported, 0);
      for (int w = 0; w < MT_WAITS; w++) atomic_store(&e->wait[w], 0);
      e->state = -1;
      return e;
    }
  }
  atomic_fetch_add(&g_dropped, 1); /* pool exhausted: drop, count, never block */
  return NULL;
}

static inline void mt_free(mt_event *e) { atomic_store_explicit(&e->used, 0, memory_order_release); }

static void mt_push(const mt_rec *r) {
  uint64_t head = atomic_load(&g_ring_head);
  for (;;) {
    if (head - atomic_load(&g_ring_tail) >= MT_RING) { atomic_fetch_add(&g_dropped, 1); return; }
    if (atomic_compare_exchange_weak(&g_ring_head, &head, head + 1)) break;
  }
  mt_rec *slot = &g_ring[head % MT_RING];
  memcpy((char *)slot + sizeof(slot->ready), (const char *)r + sizeof(r->ready), sizeof(*r) - sizeof(r->ready));
  atomic_store_explicit(&slot->ready, 1, memory_order_release);
}

static void mt_emit_coll(mt_event *c, int64_t end) {
  mt_count(end > 0 ? C_FINISHED : C_STUCK);
  mt_rec r = {0};
  r.kind = REC_COLL; r.comm_hash = c->kind == MT_P2P ? c->pair_hash : c->ctx->comm_hash;
  r.seq = c->seq;
  r.global_rank = c->ctx->global_rank; r.rank = c->ctx->rank; r.nranks = c->ctx->nranks;
  r.peer = c->peer; r.nchannels = c->nchannels; r.func = c->func; r.dtype = c->dtype;
  r.algo = c->algo; r.proto = c->proto; r.count = c->count;
  r.t_enqueue = c->t_enqueue; r.t_start = atomic_load(&c->t_start); r.t_done = end;
  for (int ph = 0; ph < MT_PHASES; ph++) r.phase[ph] = atomic_load(&c->phase[ph]);
  r.user_tag = c->user_tag; r.variant = c->variant;
  mt_push(&r);
}

static int mt_wait_index(int state);

/* A proxy op's summary. With now > 0 (a stuck op, reported as it stands) the steps
 * still open count the time spent so far in their current state, so the report
 * says where the transfer is stuck (SendGPUWait: the GPU; SendWait: the network). */
static void mt_emit_proxy(mt_event *p, int64_t now) {
  mt_event *c = p->parent;
  mt_rec r = {0};
  r.kind = REC_PROXY;
  r.comm_hash = c && c->kind == MT_P2P ? c->pair_hash : p->ctx->comm_hash;
  r.seq = c ? c->seq : 0;
  r.global_rank = p->ctx->global_rank; r.rank = p->ctx->rank; r.peer = p->peer;
  r.channel = p->channel; r.is_send = p->is_send; r.nsteps = p->nsteps;
  r.steps_done = atomic_load(&p->steps_done); r.bytes = atomic_load(&p->bytes);
  r.first = p->first; r.last = p->last;
  for (int w = 0; w < MT_WAITS; w++) r.wait[w] = atomic_load(&p->wait[w]);
  if (now > 0) {
    for (int i = 0; i < MT_POOL; i++) {
      mt_event *s = &g_pool[i];
      if (!atomic_load_explicit(&s->used, memory_order_acquire)) continue;
      if (s->kind != MT_PROXY_STEP || s->parent != p) continue;
      int w = mt_wait_index(s->state);
      if (w >= 0 && now > s->state_t) r.wait[w] += now - s->state_t;
    }
    r.last = now;
  }
  mt_push(&r);
}

static void mt_completed(mt_event *c) {
  if (c->kind != MT_COLL && c->kind != MT_CE_COLL) return;
  int64_t seq = (int64_t)c->seq, cur = atomic_load(&c->ctx->completed);
  while (seq > cur && !atomic_compare_exchange_weak(&c->ctx->completed, &cur, seq)) {}
}

/* A call is finished when it was enqueued, every kernel channel stopped, and no
 * proxy operation or kernel channel of it is still running. */
static inline int mt_finished(mt_event *c) {
  int want = c->kind == MT_CE_COLL ? 0 : c->nchannels > 0 ? c->nchannels : 1;
  return atomic_load(&c->stopped) && atomic_load(&c->pending) == 0 &&
         atomic_load(&c->kernels_done) >= want;
}

static void mt_child_done(mt_event *c, int64_t t, int kernel) {
  if (!c) return;
  if (t > c->t_done) c->t_done = t;
  if (kernel) atomic_fetch_add(&c->kernels_done, 1);
  if (atomic_fetch_sub(&c->pending, 1) == 1 && mt_finished(c)) {
    if (atomic_exchange(&c->reported, 2) == 2) return; /* finished once only */
    mt_completed(c);
    mt_emit_coll(c, c->t_done);
    mt_free(c);
  }
}

static int mt_wait_index(int state) {
  switch (state) {
    case MT_STEP_SEND_GPU_WAIT: return 0;
    case MT_STEP_SEND_PEER_WAIT: return 1;
    case MT_STEP_SEND_WAIT: return 2;
    case MT_STEP_RECV_WAIT: return 3;
    case MT_STEP_RECV_FLUSH_WAIT: return 4;
    case MT_STEP_RECV_GPU_WAIT: return 5;
    default: return -1;
  }
}

/* ------------------------------------------------------------------ output */

static const char *mt_dtype(const char *d, int *size) {
  static const struct { const char *nccl, *ours; int size; } map[] = {
      {"ncclInt8", "int8", 1}, {"ncclUint8", "uint8", 1}, {"ncclInt32", "int32", 4},
      {"ncclUint32", "uint32", 4}, {"ncclInt64", "int64", 8}, {"ncclUint64", "uint64", 8},
      {"ncclFloat16", "float16", 2}, {"ncclFloat32", "float32", 4}, {"ncclFloat64", "float64", 8},
      {"ncclBfloat16", "bfloat16", 2}, {"ncclFloat8e4m3", "fp8_e4m3", 1},
      {"ncclFloat8e5m2", "fp8_e5m2", 1},
  };
  for (size_t i = 0; d && i < sizeof(map) / sizeof(map[0]); i++)
    if (!strcmp(d, map[i].nccl)) { *size = map[i].size; return map[i].ours; }
  *size = 1;
  return "uint8";
}

/* A call's v7 fields, where it has them (its kernel phases, its tag, its variant). */
static const char *mt_extra_json(const mt_rec *r) {
  static __thread char out[320];
  static const char *names[MT_PHASES] = {"gpu_sync_ns", "gpu_move_ns", "gpu_final_sync_ns"};
  size_t n = 0;
  out[0] = 0;
  for (int ph = 0; ph < MT_PHASES; ph++)
    if (r->phase[ph] > 0)
      n += (size_t)snprintf(out + n, sizeof out - n, ",\"%s\":%lld", names[ph], (long long)r->phase[ph]);
  if (r->user_tag && n < sizeof out)
    n += (size_t)snprintf(out + n, sizeof out - n, ",\"user_tag\":%llu", (unsigned long long)r->user_tag);
  if (r->variant && r->variant[0] && n < sizeof out && !strpbrk(r->variant, "\"\\"))
    snprintf(out + n, sizeof out - n, ",\"kernel_variant\":\"%.64s\"", r->variant);
  return out;
}

static int mt_format(const mt_rec *r, char *buf, size_t cap) {
  char head[512];
  snprintf(head, sizeof head, "\"v\":1,%s%s%s\"node\":\"%s\",\"rank\":%d,\"clock\":\"host_realtime\"",
           g_job[0] ? "\"job\":\"" : "", g_job, g_job[0] ? "\"," : "", g_node, r->global_rank);
  if (r->kind == REC_COLL) {
    int size;
    const char *dt = mt_dtype(r->dtype, &size);
    char peer[32] = "null", start[32] = "null", end[32] = "null";
    if (r->peer >= 0) snprintf(peer, sizeof peer, "%d", r->peer);
    int64_t t0 = r->t_start < r->t_enqueue ? r->t_enqueue : r->t_start; /* never before the call */
    if (r->t_start > 0) snprintf(start, sizeof start, "%lld", (long long)t0);
    if (r->t_done >= t0 && r->t_done > 0) snprintf(end, sizeof end, "%lld", (long long)r->t_done);
    return snprintf(buf, cap,
                    "{\"type\":\"coll\",%s,\"comm_hash\":%llu,\"comm_size\":%d,\"rank_in_comm\":%d,"
                    "\"op\":\"%s\",\"seq\":%llu,\"count\":%zu,\"size_bytes\":%zu,\"dtype\":\"%s\","
                    "\"enqueue_ns\":%lld,\"start_ns\":%s,\"end_ns\":%s,\"peer\":%s,\"algo\":%s%s%s,\"proto\":%s%s%s,"
                    "\"nchannels\":%d%s}\n",
                    head, (unsigned long long)r->comm_hash, r->peer >= 0 ? 2 : r->nranks,
                    r->peer >= 0 ? (r->rank > r->peer) : r->rank, r->func ? r->func : "AllReduce",
                    (unsigned long long)r->seq, r->count, r->count * (size_t)size, dt,
                    (long long)r->t_enqueue, start, end, peer, r->algo ? "\"" : "", r->algo ? r->algo : "null",
                    r->algo ? "\"" : "", r->proto ? "\"" : "", r->proto ? r->proto : "null",
                    r->proto ? "\"" : "", r->nchannels, mt_extra_json(r));
  }
  int64_t first = r->first ? r->first : r->last, last = r->last > first ? r->last : first;
  int done = r->steps_done > r->nsteps ? r->nsteps : r->steps_done;
  int link = 0;
  if (r->is_send && r->bytes && r->wait[2] > 0 && done == r->nsteps) {
    /* the network's throughput towards the peer: bytes over the time spent in SendWait */
    link = snprintf(buf, cap,
                    "{\"type\":\"link\",%s,\"ts_ns\":%lld,\"window_ns\":%lld,\"nic\":\"\","
                    "\"src_rank\":%d,\"dst_rank\":%d,\"comm_hash\":%llu,\"size_bytes\":%llu,"
                    "\"throughput_gbps\":%.3f,\"wr_posted\":%d,\"wr_completed\":%d}\n",
                    head, (long long)last, (long long)r->wait[2], r->global_rank, r->peer,
                    (unsigned long long)r->comm_hash, (unsigned long long)r->bytes,
                    (double)r->bytes * 8.0 / (double)r->wait[2], r->nsteps, done);
    if (link < 0 || (size_t)link >= cap) return -1;
    buf += link;
    cap -= (size_t)link;
  }
  int n = snprintf(buf, cap,
                  "{\"type\":\"proxy\",%s,\"comm_hash\":%llu,\"seq\":%llu,\"channel\":%d,\"peer\":%d,"
                  "\"direction\":\"%s\",\"steps_posted\":%d,\"steps_done\":%d,\"size_bytes\":%llu,"
                  "\"first_ns\":%lld,\"last_ns\":%lld,\"send_gpu_wait_ns\":%lld,"
                  "\"send_peer_wait_ns\":%lld,\"send_wait_ns\":%lld,\"recv_wait_ns\":%lld,"
                  "\"recv_flush_wait_ns\":%lld,\"recv_gpu_wait_ns\":%lld}\n",
                  head, (unsigned long long)r->comm_hash, (unsigned long long)r->seq, r->channel, r->peer,
                  r->is_send ? "send" : "recv", r->nsteps, done, (unsigned long long)r->bytes,
                  (long long)first, (long long)last, (long long)r->wait[0], (long long)r->wait[1],
                  (long long)r->wait[2], (long long)r->wait[3], (long long)r->wait[4], (long long)r->wait[5]);
  return n < 0 ? n : n + link;
}

/* The agent's socket queues only a few datagrams (net.unix.max_dgram_qlen, 10 by
 * default): a burst, or an agent busy for a moment, fills it. The flusher runs on its
 * own thread, never on NCCL's, so it waits for room a little (MT_SEND_WAIT_MS at most
 * per datagram; meanwhile the ring keeps taking events) before it drops. With no agent
 * at all, or once the plugin is stopping (finalize joins that thread), it drops at once. */
#define MT_SEND_WAIT_MS 200
static void mt_send(char *buf, size_t len, int lines) {
  if (g_sock < 0 || !len) return;
  for (int waited = 0;; waited++) {
    if (sendto(g_sock, buf, len, MSG_DONTWAIT, (struct sockaddr *)&g_addr, sizeof g_addr) >= 0) {
      atomic_fetch_add(&g_sent, (uint64_t)lines);
      return;
    }
    if ((errno != EAGAIN && errno != EWOULDBLOCK && errno != ENOBUFS) || waited >= MT_SEND_WAIT_MS ||
        atomic_load(&g_stop))
      break;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  atomic_fetch_add(&g_dropped, (uint64_t)lines); /* no agent, or it stayed full: drop, count */
}

static void mt_flush(void) {
  static char buf[60000];
  size_t len = 0;
  int lines = 0;
  char line[4096];
  for (;;) {
    uint64_t tail = atomic_load(&g_ring_tail);
    if (tail == atomic_load(&g_ring_head)) break;
    mt_rec *slot = &g_ring[tail % MT_RING];
    if (!atomic_load_explicit(&slot->ready, memory_order_acquire)) break;
    int n = mt_format(slot, line, sizeof line);
    atomic_store_explicit(&slot->ready, 0, memory_order_relaxed);
    atomic_store(&g_ring_tail, tail + 1);
    if (n <= 0 || (size_t)n >= sizeof line) continue;
    if (len + (size_t)n > sizeof buf) { mt_send(buf, len, lines); len = 0; lines = 0; }
    memcpy(buf + len, line, (size_t)n);
    len += (size_t)n;
    lines++;
  }
  mt_send(buf, len, lines);
}

static void mt_report_stuck(void) {
  int64_t now = mt_now();
  for (int i = 0; i < MT_POOL; i++) {
    mt_event *e = &g_pool[i];
    if (!atomic_load_explicit(&e->used, memory_order_acquire)) continue;
    if ((e->kind == MT_COLL || e->kind == MT_P2P) && atomic_load(&e->stopped) &&
        atomic_load(&e->children) == 0 && now - e->t_enqueue > 10 * 1000000000LL) {
      mt_emit_coll(e, 0); /* never saw its kernels or proxy work: reported without an end */
      mt_free(e);
      continue;
    }
    if ((e->kind == MT_COLL || e->kind == MT_P2P) && atomic_load(&e->stopped) &&
        now - e->t_enqueue > g_stuck_ns && !atomic_load(&e->reported)) {
      atomic_store(&e->reported, 1);
      mt_emit_coll(e, 0); /* joined, not finished: reported without an end */
      continue;
    }
    if (e->kind != MT_PROXY_OP) continue;
    if (!e->first || now - e->first < g_stuck_ns || atomic_load(&e->reported)) continue;
    if (atomic_load(&e->steps_done) >= e->nsteps) continue;
    atomic_store(&e->reported, 1);
    mt_emit_proxy(e, now); /* posted, not done: as it stands */
  }
}

/* The process's threads' CPU time and run-queue wait (ns, summed over the live ones:
 * /proc/self/task/<tid>/schedstat), as the heartbeats carry them; 0 where the kernel
 * keeps none. A rank starved of CPU (a crowded host, a container's quota) launches its
 * kernels late; its wait says so directly. */
static int mt_process_cpu(long long *run, long long *wait) {
  DIR *dir = opendir("/proc/self/task");
  if (!dir) return 0;
  long long r = 0, w = 0;
  struct dirent *d;
  char path[64];
  while ((d = readdir(dir)) != NULL) {
    if (d->d_name[0] < '0' || d->d_name[0] > '9') continue;
    snprintf(path, sizeof path, "/proc/self/task/%.20s/schedstat", d->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue; /* the thread ended while we listed them */
    long long a = 0, b = 0;
    if (fscanf(f, "%lld %lld", &a, &b) == 2) {
      r += a;
      w += b;
    }
    fclose(f);
  }
  closedir(dir);
  *run = r;
  *wait = w;
  return r > 0;
}

/* Whether the comma-separated list `opts` names `word`. */
static int mt_has_opt(const char *opts, const char *word) {
  size_t n = strlen(word);
  for (const char *p = opts; p != NULL;) {
    if (strncmp(p, word, n) == 0 && (p[n] == ',' || p[n] == '\0')) return 1;
    p = strchr(p, ',');
    if (p) p++;
  }
  return 0;
}

/* The throttled time (ns) the cpu.stat in directory `dir` gives (cgroup v1's
 * throttled_time, v2's throttled_usec); -1 where it has none. */
static long long mt_stat_throttled(const char *dir) {
  char path[1100], name[64];
  long long value = 0, got = -1;
  snprintf(path, sizeof path, "%s/cpu.stat", dir);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  while (got < 0 && fscanf(f, "%63s %lld", name, &value) == 2) {
    if (!strcmp(name, "throttled_time")) got = value;
    if (!strcmp(name, "throttled_usec")) got = value * 1000;
  }
  fclose(f);
  return got;
}

/* How long the process's CPU cgroup and those above it (to its mount's root: a pod's
 * limit and its container's) were throttled, summed (ns); -1 where none is readable.
 * The cgroup comes from /proc/self/cgroup (a v1 hierarchy with the cpu controller, else
 * v2), read anew each time since a process can be moved, and where it is mounted from
 * mountinfo, read once. The same reading as producers/host_cpu.py's cgroup_throttled. */
static long long mt_cgroup_throttled(void) {
  /* where the hierarchies are mounted is read once (the heartbeat thread alone calls
   * this); which group the process is in, every time */
  static char root[2][512], point[2][512];
  static int mounted[2] = {0, 0}, mounts_read = 0; /* [0]: v1 with cpu, [1]: v2 */
  char line[4096], cg[2][512] = {"", ""};
  int have[2] = {0, 0};
  FILE *f = fopen("/proc/self/cgroup", "r");
  if (!f) return -1;
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    char *ctrls = strchr(line, ':');
    char *path = ctrls ? strchr(ctrls + 1, ':') : NULL;
    if (!path) continue;
    *path++ = '\0';
    ctrls++;
    int v2 = !strcmp(line, "0") && *ctrls == '\0';
    if (v2 ? !have[1] : mt_has_opt(ctrls, "cpu")) {
      snprintf(cg[v2], sizeof cg[v2], "%s", path);
      have[v2] = 1;
    }
  }
  fclose(f);
  if (!mounts_read) {
    if (!(f = fopen("/proc/self/mountinfo", "r"))) return -1;
    mounts_read = 1;
  } else {
    f = NULL;
  }
  while (f && fgets(line, sizeof line, f)) {
    char r[512], p[512], type[64], opts[512];
    char *dash = strstr(line, " - ");
    if (!dash || sscanf(line, "%*s %*s %*s %511s %511s", r, p) != 2 ||
        sscanf(dash + 3, "%63s %*s %511s", type, opts) != 2)
      continue;
    int v2 = !strcmp(type, "cgroup2");
    if ((!v2 && !(!strcmp(type, "cgroup") && mt_has_opt(opts, "cpu"))) || mounted[v2]) continue;
    snprintf(root[v2], sizeof root[v2], "%s", r);
    snprintf(point[v2], sizeof point[v2], "%s", p);
    mounted[v2] = 1;
  }
  if (f) fclose(f);
  for (int v2 = 0; v2 < 2; v2++) { /* v1's cpu hierarchy first (a hybrid host) */
    if (!have[v2] || !mounted[v2]) continue;
    const char *path = cg[v2];
    size_t n = strlen(root[v2]);
    if (strcmp(root[v2], "/") != 0) {
      if (strncmp(path, root[v2], n) != 0 || (path[n] != '\0' && path[n] != '/')) continue;
      path += n;
    }
    char dir[1100];
    size_t base = strlen(point[v2]);
    snprintf(dir, sizeof dir, "%s%s", point[v2], path);
    while (strlen(dir) > base && dir[strlen(dir) - 1] == '/') dir[strlen(dir) - 1] = '\0';
    long long total = 0;
    int seen = 0;
    for (;;) {
      long long got = mt_stat_throttled(dir);
      if (got >= 0) {
        total += got;
        seen = 1;
      }
      char *slash = strrchr(dir, '/');
      if (strlen(dir) <= base || !slash || (size_t)(slash - dir) < base) break;
      *slash = '\0';
    }
    if (seen) return total;
  }
  return -1;
}

static void mt_heartbeats(void) {
  /* one liveness record per global rank of this process, with its communicators' progress */
  static char buf[60000];
  size_t len = 0;
  int lines = 0;
  int64_t now = mt_now();
  long long cpu_run = 0, cpu_wait = 0, throttled = mt_cgroup_throttled();
  char cpu[160] = "";
  size_t at = 0;
  if (mt_process_cpu(&cpu_run, &cpu_wait))
    at = (size_t)snprintf(cpu, sizeof cpu, "\"cpu_ns\":%lld,\"cpu_wait_ns\":%lld,", cpu_run,
                          cpu_wait);
  if (throttled >= 0 && at < sizeof cpu)
    snprintf(cpu + at, sizeof cpu - at, "\"cpu_throttled_ns\":%lld,", throttled);
  pthread_mutex_lock(&g_ctx_lock);
  for (int i = 0; i < MT_MAX_CTX; i++) {
    mt_ctx *c = g_ctxs[i];
    if (!c) continue;
    int seen = 0;
    for (int j = 0; j < i; j++) seen |= g_ctxs[j] && g_ctxs[j]->global_rank == c->global_rank;
    if (seen) continue;
    int n = snprintf(buf + len, sizeof buf - len,
                     "{\"type\":\"hb\",\"v\":1,%s%s%s\"node\":\"%s\",\"rank\":%d,\"ts_ns\":%lld,"
                     "\"pid\":%d,%s\"comms\":[",
                     g_job[0] ? "\"job\":\"" : "", g_job, g_job[0] ? "\"," : "", g_node,
                     c->global_rank, (long long)now, (int)getpid(), cpu);
    if (n < 0 || (size_t)n >= sizeof buf - len - 256) break;
    len += (size_t)n;
    int first = 1;
    for (int j = i; j < MT_MAX_CTX && len < sizeof buf - 256; j++) {
      mt_ctx *d = g_ctxs[j];
      if (!d || d->global_rank != c->global_rank) continue;
      n = snprintf(buf + len, sizeof buf - len,
                   "%s{\"comm_hash\":%llu,\"issued_seq\":%lld,\"completed_seq\":%lld}",
                   first ? "" : ",", (unsigned long long)d->comm_hash,
                   (long long)atomic_load(&d->issued), (long long)atomic_load(&d->completed));
      if (n > 0) len += (size_t)n;
      first = 0;
    }
    len += (size_t)snprintf(buf + len, sizeof buf - len, "]}\n");
    lines++;
  }
  pthread_mutex_unlock(&g_ctx_lock);
  mt_send(buf, len, lines);
}

/* The flusher thread and an explicit flush (tests, health) both drain: one at a time,
 * since the send buffer is shared and a drain only counts its records once sent. */
static pthread_mutex_t g_drain_lock = PTHREAD_MUTEX_INITIALIZER;
static void mt_drain(int stuck) {
  pthread_mutex_lock(&g_drain_lock);
  if (stuck) mt_report_stuck();
  mt_flush();
  pthread_mutex_unlock(&g_drain_lock);
}

static void *mt_flusher(void *arg) {
  (void)arg;
  int64_t next_hb = 0;
  while (!atomic_load(&g_stop)) {
    struct timespec ts = {0, 20 * 1000000};
    nanosleep(&ts, NULL);
    mt_drain(1);
    int64_t now = mt_now();
    if (now >= next_hb) {
      mt_heartbeats();
      next_hb = now + g_heartbeat_ns;
    }
  }
  mt_drain(0);
  return NULL;
}

/* ------------------------------------------------------------------ callbacks */

static mt_result_t mt_init_common(void **context, int *mask, uint64_t comm_hash, int nnodes,
                                  int nranks, int rank, mt_logger_t logfn) {
  mt_ctx *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return 1;
  ctx->comm_hash = comm_hash; ctx->rank = rank; ctx->nranks = nranks; ctx->nnodes = nnodes;
  const char *grank = getenv("RANK");
  ctx->global_rank = grank ? atoi(grank) : rank;
  ctx->p2p_seq = calloc(2 * (size_t)(nranks > 0 ? nranks : 1), sizeof(*ctx->p2p_seq));
  atomic_store(&ctx->issued, -1);
  atomic_store(&ctx->completed, -1);
  pthread_mutex_lock(&g_ctx_lock);
  for (int i = 0; i < MT_MAX_CTX; i++)
    if (!g_ctxs[i]) { g_ctxs[i] = ctx; break; }
  pthread_mutex_unlock(&g_ctx_lock);
  *context = ctx;
  *mask = MT_COLL | MT_P2P | MT_PROXY_OP | MT_PROXY_STEP | MT_KERNEL_CH;
  if (atomic_fetch_add(&g_refs, 1) == 0) {
    g_log = logfn;
    gethostname(g_node, sizeof g_node - 1);
    const char *job = getenv("MEGATRACE_JOB");
    snprintf(g_job, sizeof g_job, "%s", job ? job : "");
    const char *stuck = getenv("MEGATRACE_STUCK_MS");
    if (stuck) g_stuck_ns = atoll(stuck) * 1000000LL;
    const char *hb = getenv("MEGATRACE_HEARTBEAT_MS");
    if (hb) g_heartbeat_ns = atoll(hb) * 1000000LL;
    const char *path = getenv("MEGATRACE_AGENT__SOCKET");
    memset(&g_addr, 0, sizeof g_addr);
    g_addr.sun_family = AF_UNIX;
    snprintf(g_addr.sun_path, sizeof g_addr.sun_path, "%s", path ? path : ".megatrace/agent.sock");
    g_sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK, 0);
    atomic_store(&g_stop, 0);
    pthread_create(&g_flusher, NULL, mt_flusher, NULL);
  }
  return 0;
}

static mt_result_t mt_start(mt_ctx *ctx, void **handle, uint64_t type, void *parent_obj,
                            const struct mt_coll_descr *coll, const struct mt_p2p_descr *p2p,
                            const void *descr_union, const mt_extra *x) {
  *handle = NULL;
  atomic_fetch_add_explicit(&g_events, 1, memory_order_relaxed);
  if (type == MT_CE_SYNC || type == MT_CE_BATCH) { /* parts of a copy-engine call: counted */
    mt_count(C_CE_PART);
    return 0;
  }
  if (type == MT_CE_COLL && x && x->ce) { /* a collective run by the copy engines */
    mt_count(C_CE_COLL);
    mt_event *e = mt_alloc();
    if (!e) return 0;
    const struct mt_ce_coll_descr *ce = x->ce;
    e->kind = MT_CE_COLL; e->ctx = ctx; e->peer = -1; e->seq = ce->seqNumber;
    e->func = ce->func; e->dtype = ce->datatype; e->count = ce->count; e->algo = "CE";
    e->user_tag = x->user_tag;
    e->t_enqueue = mt_now();
    atomic_store(&e->t_start, e->t_enqueue); /* the engines start on their stream at once */
    int64_t seq = (int64_t)ce->seqNumber, cur = atomic_load(&ctx->issued);
    while (seq > cur && !atomic_compare_exchange_weak(&ctx->issued, &cur, seq)) {}
    *handle = e;
    return 0;
  }
  if (type == MT_KERNEL_PHASE) { /* a phase of a kernel channel: timed by the GPU */
    mt_count(C_KERNEL_PHASE);
    mt_event *ch = parent_obj;
    /* its channel event, whose parent is the call (a channel already gone: orphan) */
    if (!x || !ch || !atomic_load(&ch->used) || ch->kind != MT_KERNEL_CH || !ch->parent ||
        x->phase_id < 0 || x->phase_id >= MT_PHASES) {
      mt_count(C_ORPHAN);
      return 0;
    }
    mt_event *e = mt_alloc();
    if (!e) return 0;
    e->kind = MT_KERNEL_PHASE; e->ctx = ctx; e->parent = ch->parent;
    e->phase_id = x->phase_id; e->phase_timer = x->phase_timer;
    *handle = e;
    return 0;
  }
  if (type != MT_COLL && type != MT_P2P && type != MT_PROXY_OP && type != MT_PROXY_STEP &&
      type != MT_KERNEL_CH)
    return 0;
  mt_count(type == MT_COLL ? C_COLL : type == MT_P2P ? C_P2P : type == MT_PROXY_OP ? C_PROXY_OP
           : type == MT_PROXY_STEP ? C_PROXY_STEP : C_KERNEL_CH);
  if ((type == MT_PROXY_OP || type == MT_KERNEL_CH) && !parent_obj) mt_count(C_ORPHAN);
  if (type == MT_P2P && p2p->peer == ctx->rank) {
    /* A transfer to itself: NCCL copies it inside the kernel with no proxy operation,
     * so no KernelCh event ever says it ended (seen on NCCL 2.28.9). It waits on
     * nobody; tracking it would only report it stuck. Counted, not recorded. */
    mt_count(C_SELF);
    return 0;
  }
  mt_event *e = mt_alloc();
  if (!e) return 0;
  e->kind = (int)type;
  e->ctx = ctx;
  e->peer = -1;
  if (x) { e->user_tag = x->user_tag; e->variant = x->variant; }
  if (type == MT_COLL) {
    e->seq = coll->seqNumber; e->func = coll->func; e->dtype = coll->datatype; e->count = coll->count;
    e->algo = coll->algo; e->proto = coll->proto; e->nchannels = coll->nChannels;
    e->t_enqueue = mt_now();
    int64_t seq = (int64_t)coll->seqNumber, cur = atomic_load(&ctx->issued);
    while (seq > cur && !atomic_compare_exchange_weak(&ctx->issued, &cur, seq)) {}
  } else if (type == MT_P2P) {
    int send = p2p->func && !strcmp(p2p->func, "Send");
    int peer = p2p->peer;
    int sender_side = send ? 0 : 1;
    e->func = p2p->func; e->dtype = p2p->datatype; e->count = p2p->count; e->peer = peer;
    e->nchannels = p2p->nChannels;
    e->seq = (peer >= 0 && peer < ctx->nranks)
                 ? atomic_fetch_add(&ctx->p2p_seq[2 * peer + sender_side], 1) : 0;
    uint64_t lo = (uint64_t)(ctx->rank < peer ? ctx->rank : peer);
    uint64_t hi = (uint64_t)(ctx->rank < peer ? peer : ctx->rank);
    e->pair_hash = mt_mix(ctx->comm_hash ^ (lo << 32 | hi)) >> 1;
    e->t_enqueue = mt_now();
  } else {
    mt_event *parent = (mt_event *)parent_obj;
    e->parent = parent;
    if (type == MT_PROXY_OP) {
      const struct mt_proxy_op_descr *op = descr_union;
      e->channel = op->channelId; e->peer = op->peer; e->nsteps = op->nSteps; e->is_send = op->isSend;
      if (parent) { atomic_fetch_add(&parent->pending, 1); atomic_fetch_add(&parent->children, 1); }
    } else if (type == MT_KERNEL_CH) {
      if (parent) {
        atomic_fetch_add(&parent->pending, 1); atomic_fetch_add(&parent->children, 1);
        int64_t none = 0; /* the first channel to start says when the GPU reached the call */
        atomic_compare_exchange_strong(&parent->t_start, &none, mt_now());
      }
    } else { /* proxy step: its parent is the proxy op */
      int64_t now = mt_now();
      if (parent && !parent->first) parent->first = now;
      e->state_t = now;
    }
  }
  *handle = e;
  return 0;
}

static mt_result_t mt_stop(void *handle) {
  mt_event *e = handle;
  if (!e) return 0;
  int64_t now = mt_now();
  switch (e->kind) {
    case MT_KERNEL_PHASE:
      mt_free(e);
      return 0;
    case MT_CE_COLL: /* the copy engines are done: the call ended */
      e->t_done = now;
      /* fall through */
    case MT_COLL:
    case MT_P2P:
      e->t_enqueue = e->t_enqueue ? e->t_enqueue : now;
      atomic_store(&e->stopped, 1);
      if (mt_finished(e)) { /* its kernels and proxy work already finished */
        if (atomic_exchange(&e->reported, 2) == 2) return 0; /* finished once only */
        mt_completed(e);
        mt_emit_coll(e, e->t_done);
        mt_free(e);
      } /* else: the last child to stop finishes it */
      return 0;
    case MT_PROXY_STEP: {
      mt_event *op = e->parent;
      int w = mt_wait_index(e->state);
      if (op) {
        if (w >= 0) atomic_fetch_add_explicit(&op->wait[w], now - e->state_t, memory_order_relaxed);
        atomic_fetch_add_explicit(&op->steps_done, 1, memory_order_relaxed);
        op->last = now;
      }
      mt_free(e);
      return 0;
    }
    case MT_PROXY_OP: {
      if (!e->first) e->first = now;
      if (!e->last) e->last = now;
      mt_emit_proxy(e, 0);
      mt_event *parent = e->parent;
      mt_free(e);
      mt_child_done(parent, now, 0);
      return 0;
    }
    case MT_KERNEL_CH: {
      mt_count(C_KERNEL_CH_STOP);
      mt_event *parent = e->parent;
      mt_free(e);
      mt_child_done(parent, now, 1);
      return 0;
    }
  }
  mt_free(e);
  return 0;
}

static mt_result_t mt_record(void *handle, int state, mt_state_args *args) {
  mt_event *e = handle;
  if (e && e->kind == MT_KERNEL_PHASE && state == MT_KERNEL_PHASE_STOP && args) {
    /* the phase's GPU-timed length; the call keeps the longest over its channels */
    int64_t d = (int64_t)(args->kernelCh.pTimer - e->phase_timer), cur;
    _Atomic int64_t *slot = &e->parent->phase[e->phase_id];
    cur = atomic_load(slot);
    while (d > cur && !atomic_compare_exchange_weak(slot, &cur, d)) {}
    return 0;
  }
  if (!e || e->kind != MT_PROXY_STEP) return 0;
  int64_t now = mt_now();
  int w = mt_wait_index(e->state);
  mt_event *op = e->parent;
  if (op && w >= 0) atomic_fetch_add_explicit(&op->wait[w], now - e->state_t, memory_order_relaxed);
  e->state = state;
  e->state_t = now;
  if (op && state == MT_STEP_SEND_WAIT && args)
    atomic_fetch_add_explicit(&op->bytes, args->proxyStep.transSize, memory_order_relaxed);
  if (op && state == MT_STEP_RECV_WAIT && args && args->proxyStep.transSize)
    atomic_fetch_add_explicit(&op->bytes, args->proxyStep.transSize, memory_order_relaxed);
  return 0;
}

static mt_result_t mt_finalize(void *context) {
  mt_ctx *ctx = context;
  if (atomic_fetch_sub(&g_refs, 1) == 1) {
    atomic_store(&g_stop, 1);
    pthread_join(g_flusher, NULL);
    if (g_sock >= 0) close(g_sock);
    g_sock = -1;
  }
  if (ctx) {
    pthread_mutex_lock(&g_ctx_lock);
    for (int i = 0; i < MT_MAX_CTX; i++)
      if (g_ctxs[i] == ctx) g_ctxs[i] = NULL;
    pthread_mutex_unlock(&g_ctx_lock);
    free(ctx->p2p_seq);
    free(ctx);
  }
  return 0;
}

/* v4 */
static mt_result_t init_v4(void **context, int *mask, const char *name, uint64_t comm_hash,
                           int nnodes, int nranks, int rank, mt_logger_t logfn) {
  (void)name;
  return mt_init_common(context, mask, comm_hash, nnodes, nranks, rank, logfn);
}
static mt_result_t start_v4(void *context, void **handle, mt_descr_v4 *d) {
  return mt_start(context, handle, d->type, d->parentObj, &d->coll, &d->p2p, &d->proxyOp, NULL);
}
static mt_result_t record_v4(void *handle, int state, mt_state_args *args) { return mt_record(handle, state, args); }

/* v5 */
static mt_result_t init_v5(void **context, uint64_t comm_id, int *mask, const char *name,
                           int nnodes, int nranks, int rank, mt_logger_t logfn) {
  (void)name;
  return mt_init_common(context, mask, comm_id, nnodes, nranks, rank, logfn);
}
static mt_result_t start_v5(void *context, void **handle, mt_descr_v5 *d) {
  return mt_start(context, handle, d->type, d->parentObj, &d->coll.d, &d->p2p.d, &d->proxyOp,
                  NULL);
}

/* v6: v5's events and the copy-engine collectives */
static mt_result_t init_v6(void **context, uint64_t comm_id, int *mask, const char *name,
                           int nnodes, int nranks, int rank, mt_logger_t logfn) {
  mt_result_t rc = init_v5(context, comm_id, mask, name, nnodes, nranks, rank, logfn);
  *mask |= MT_CE_COLL;
  return rc;
}
static mt_result_t start_v6(void *context, void **handle, mt_descr_v6 *d) {
  mt_extra x = {0, NULL, d->type == MT_CE_COLL ? &d->ceColl : NULL, -1, 0};
  return mt_start(context, handle, d->type, d->parentObj, &d->coll.d, &d->p2p.d, &d->proxyOp,
                  &x);
}

/* v7: the user's tag, the kernel variant, and (asked for) the kernel's phases */
static mt_result_t init_v7(void **context, uint64_t comm_id, int *mask, const char *name,
                           int nnodes, int nranks, int rank, mt_logger_t logfn) {
  mt_result_t rc = init_v6(context, comm_id, mask, name, nnodes, nranks, rank, logfn);
  const char *phases = getenv("MEGATRACE_KERNEL_PHASES");
  if (phases && phases[0] == '1') *mask |= MT_KERNEL_PHASE;
  return rc;
}
static mt_result_t start_v7(void *context, void **handle, mt_descr_v7 *d) {
  mt_extra x = {0, NULL, NULL, -1, 0};
  switch (d->type) {
    case MT_COLL: x.user_tag = d->coll.userTag; x.variant = d->coll.kernelVariant; break;
    case MT_P2P: x.user_tag = d->p2p.userTag; break;
    case MT_CE_COLL: x.user_tag = d->ceColl.userTag; x.ce = &d->ceColl.d; break;
    case MT_KERNEL_PHASE:
      x.phase_id = d->kernelPhase.phaseId; x.phase_timer = d->kernelPhase.pTimer; break;
    default: break;
  }
  return mt_start(context, handle, d->type, d->parentObj, &d->coll.d, &d->p2p.d, &d->proxyOp,
                  &x);
}

typedef struct {
  const char *name;
  mt_result_t (*init)(void **, int *, const char *, uint64_t, int, int, int, mt_logger_t);
  mt_result_t (*startEvent)(void *, void **, mt_descr_v4 *);
  mt_result_t (*stopEvent)(void *);
  mt_result_t (*recordEventState)(void *, int, mt_state_args *);
  mt_result_t (*finalize)(void *);
} mt_profiler_v4;

typedef struct {
  const char *name;
  mt_result_t (*init)(void **, uint64_t, int *, const char *, int, int, int, mt_logger_t);
  mt_result_t (*startEvent)(void *, void **, mt_descr_v5 *);
  mt_result_t (*stopEvent)(void *);
  mt_result_t (*recordEventState)(void *, int, mt_state_args *);
  mt_result_t (*finalize)(void *);
} mt_profiler_v5;

typedef struct {
  const char *name;
  mt_result_t (*init)(void **, uint64_t, int *, const char *, int, int, int, mt_logger_t);
  mt_result_t (*startEvent)(void *, void **, mt_descr_v6 *);
  mt_result_t (*stopEvent)(void *);
  mt_result_t (*recordEventState)(void *, int, mt_state_args *);
  mt_result_t (*finalize)(void *);
} mt_profiler_v6;

typedef struct {
  const char *name;
  mt_result_t (*init)(void **, uint64_t, int *, const char *, int, int, int, mt_logger_t);
  mt_result_t (*startEvent)(void *, void **, mt_descr_v7 *);
  mt_result_t (*stopEvent)(void *);
  mt_result_t (*recordEventState)(void *, int, mt_state_args *);
  mt_result_t (*finalize)(void *);
} mt_profiler_v7;

__attribute__((visibility("default"))) const mt_profiler_v7 ncclProfiler_v7 = {
    "megatrace", init_v7, start_v7, mt_stop, record_v4, mt_finalize};
__attribute__((visibility("default"))) const mt_profiler_v6 ncclProfiler_v6 = {
    "megatrace", init_v6, start_v6, mt_stop, record_v4, mt_finalize};
__attribute__((visibility("default"))) const mt_profiler_v5 ncclProfiler_v5 = {
    "megatrace", init_v5, start_v5, mt_stop, record_v4, mt_finalize};
__attribute__((visibility("default"))) const mt_profiler_v4 ncclProfiler_v4 = {
    "megatrace", init_v4, start_v4, mt_stop, record_v4, mt_finalize};

/* For tests and health: events seen, records sent, records dropped; and a flush. */
__attribute__((visibility("default"))) void megatrace_profiler_stats(uint64_t out[3]) {
  out[0] = atomic_load(&g_events); out[1] = atomic_load(&g_sent); out[2] = atomic_load(&g_dropped);
}
/* The health counters (see g_counts), C_NCOUNTS of them. */
__attribute__((visibility("default"))) int megatrace_profiler_counts(uint64_t *out) {
  for (int i = 0; i < C_NCOUNTS; i++) out[i] = atomic_load(&g_counts[i]);
  return C_NCOUNTS;
}
__attribute__((visibility("default"))) void megatrace_profiler_flush(void) { mt_drain(1); }

/* Micro-benchmark through the same entry points NCCL calls: ns per proxy-step
 * state change, per whole proxy step (start, two states, stop) and per
 * collective (call, one proxy op of `steps` steps per direction, a kernel
 * channel). out_ns[0..2]. */
__attribute__((visibility("default"))) void megatrace_profiler_bench(int n, double out_ns[4]) {
  void *ctx = NULL;
  int mask = 0;
  ncclProfiler_v5.init(&ctx, 0x1234, &mask, "bench", 1, 2, 0, NULL);
  mt_descr_v5 d;
  memset(&d, 0, sizeof d);
  mt_state_args args = {.proxyStep = {.transSize = 65536}};
  /* one long-lived proxy op holding the steps */
  void *coll = NULL, *op = NULL, *step = NULL;
  d.type = MT_COLL; d.coll.d.func = "AllReduce"; d.coll.d.datatype = "ncclBfloat16";
  d.coll.d.nChannels = 1;
  ncclProfiler_v5.startEvent(ctx, &coll, &d);
  memset(&d, 0, sizeof d);
  d.type = MT_PROXY_OP; d.parentObj = coll; d.proxyOp.nSteps = 1 << 30; d.proxyOp.isSend = 1;
  ncclProfiler_v5.startEvent(ctx, &op, &d);
  memset(&d, 0, sizeof d);
  d.type = MT_PROXY_STEP; d.parentObj = op;
  ncclProfiler_v5.startEvent(ctx, &step, &d);
  int64_t t0 = mt_now();
  for (int i = 0; i < n; i++)
    ncclProfiler_v5.recordEventState(step, (i & 1) ? MT_STEP_SEND_WAIT : MT_STEP_SEND_GPU_WAIT, &args);
  out_ns[0] = (double)(mt_now() - t0) / n;
  ncclProfiler_v5.stopEvent(step);
  t0 = mt_now();
  for (int i = 0; i < n; i++) {
    void *s = NULL;
    ncclProfiler_v5.startEvent(ctx, &s, &d);
    ncclProfiler_v5.recordEventState(s, MT_STEP_SEND_GPU_WAIT, &args);
    ncclProfiler_v5.recordEventState(s, MT_STEP_SEND_WAIT, &args);
    ncclProfiler_v5.stopEvent(s);
  }
  out_ns[1] = (double)(mt_now() - t0) / n;
  ncclProfiler_v5.stopEvent(op);
  ncclProfiler_v5.stopEvent(coll);
  int colls = n / 16 > 0 ? n / 16 : 1;
  t0 = mt_now();
  for (int i = 0; i < colls; i++) {
    void *c = NULL, *o[2] = {NULL, NULL}, *k = NULL;
    memset(&d, 0, sizeof d);
    d.type = MT_COLL; d.coll.d.seqNumber = (uint64_t)i; d.coll.d.func = "AllReduce";
    d.coll.d.datatype = "ncclBfloat16"; d.coll.d.nChannels = 1; d.coll.d.count = 1 << 20;
    ncclProfiler_v5.startEvent(ctx, &c, &d);
    ncclProfiler_v5.stopEvent(c);
    for (int dir = 0; dir < 2; dir++) {
      memset(&d, 0, sizeof d);
      d.type = MT_PROXY_OP; d.parentObj = c; d.proxyOp.peer = 1; d.proxyOp.nSteps = 4;
      d.proxyOp.isSend = !dir;
      ncclProfiler_v5.startEvent(ctx, &o[dir], &d);
      for (int s = 0; s < 4; s++) {
        void *st = NULL;
        memset(&d, 0, sizeof d);
        d.type = MT_PROXY_STEP; d.parentObj = o[dir];
        ncclProfiler_v5.startEvent(ctx, &st, &d);
        ncclProfiler_v5.recordEventState(st, dir ? MT_STEP_RECV_WAIT : MT_STEP_SEND_WAIT, &args);
        ncclProfiler_v5.stopEvent(st);
      }
    }
    memset(&d, 0, sizeof d);
    d.type = MT_KERNEL_CH; d.parentObj = c;
    ncclProfiler_v5.startEvent(ctx, &k, &d);
    ncclProfiler_v5.stopEvent(o[0]);
    ncclProfiler_v5.stopEvent(o[1]);
    ncclProfiler_v5.stopEvent(k);
    if ((i & 255) == 255) megatrace_profiler_flush(); /* keep the ring from filling */
  }
  out_ns[2] = (double)(mt_now() - t0) / colls;
  ncclProfiler_v5.finalize(ctx);
  /* v7: one kernel phase (start, its GPU-timed stop, stop) under a live kernel channel */
  ncclProfiler_v7.init(&ctx, 0x1234, &mask, "bench", 1, 2, 0, NULL);
  mt_descr_v7 d7;
  memset(&d7, 0, sizeof d7);
  void *c7 = NULL, *k7 = NULL;
  d7.type = MT_COLL; d7.coll.d.func = "AllReduce"; d7.coll.d.datatype = "ncclBfloat16";
  d7.coll.d.nChannels = 1;
  ncclProfiler_v7.startEvent(ctx, &c7, &d7);
  memset(&d7, 0, sizeof d7);
  d7.type = MT_KERNEL_CH; d7.parentObj = c7;
  ncclProfiler_v7.startEvent(ctx, &k7, &d7);
  mt_state_args stop = {.kernelCh = {.pTimer = 2000}};
  t0 = mt_now();
  for (int i = 0; i < n; i++) {
    void *ph = NULL;
    memset(&d7, 0, sizeof d7);
    d7.type = MT_KERNEL_PHASE; d7.parentObj = k7;
    d7.kernelPhase.phaseId = (uint8_t)(i % MT_PHASES); d7.kernelPhase.pTimer = 1000;
    ncclProfiler_v7.startEvent(ctx, &ph, &d7);
    ncclProfiler_v7.recordEventState(ph, MT_KERNEL_PHASE_STOP, &stop);
    ncclProfiler_v7.stopEvent(ph);
  }
  out_ns[3] = (double)(mt_now() - t0) / n;
  ncclProfiler_v7.stopEvent(k7);
  ncclProfiler_v7.stopEvent(c7);
  ncclProfiler_v7.finalize(ctx);
}
