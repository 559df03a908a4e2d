/* The CUDA writer's chunk loop in C (backends/cuda_writer.py, Note [the chunk loop in C]).
 *
 * wc_stage_copy moves nbytes of a file into device memory through a ring of small pinned
 * slots: for each slot's worth it waits for the copy that last read that slot, preads
 * into it, and queues its host-to-device copy on the ring's stream. Called through ctypes,
 * which releases the GIL for the call: a loader thread's whole chunk runs without Python
 * between the slots. Only the driver API, resolved with dlopen at the first call: no CUDA
 * headers or toolkit at build time, and a host without a driver can still import the
 * package.
 *
 * wc_stage_tasks runs a load's tasks (runs of whole hash pieces, contiguous in file and
 * arena) through the same ring, claiming them one at a time from a table the loader
 * threads share, and launches each task's hash kernels once its copies are queued: a
 * thread makes one call for many tasks, not one per chunk (cuda_writer.py, Note [a
 * thread's tasks in one call]).
 *
 * Returns 0; > 0, the CUresult of the driver call that failed; < 0, -errno of a failed
 * pread; WC_SHORT where the file ended before nbytes (truncated under the load). The ring
 * stays consistent after an error: every slot whose copy was queued is marked busy.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#define WC_MAX_SLOTS 16
#define WC_MAX_HASH_STREAMS 8
#define WC_SHORT (-1000000)
#define WC_MORE (-1000001)       /* wc_stage_tasks: the call's byte budget is spent, tasks are left */
#define WC_NEED_ROOM (-1000002)  /* wc_stage_tasks: task *at ends past the arena's mapped bytes */
#define WC_STOPPED (-1000003)    /* wc_stage_tasks: the table's stop was set (a failure elsewhere) */
#define WC_NO_DRIVER 999999

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

typedef struct {
    void *stream;                 /* CUstream the copies are queued on, in order */
    void *events[WC_MAX_SLOTS];   /* CUevent recorded after each slot's copy */
    int busy[WC_MAX_SLOTS];       /* a copy out of the slot may still run */
    int next;                     /* the slot to fill next */
    int nslots;
    size_t slot_bytes;
    char *buf;                    /* pinned, nslots * slot_bytes */
    /* wc_stage_tasks only: where a task's hash kernels run, in turn, once they have waited
     * for the copies on `stream` (an event recorded there). */
    void *copied;
    void *hash_streams[WC_MAX_HASH_STREAMS];
    int nhash;
    int next_hash;
} wc_ring;

/* A load's tasks, shared by its loader threads: each claims the next one (`next`). */
typedef struct {
    long long ntasks;
    long long next;                        /* atomic */
    int stop;                              /* atomic; set from Python when the load fails */
    unsigned long long mapped;             /* atomic; the arena's mapped bytes, raised by Python */
    CUdeviceptr base;                      /* the arena's first byte */
    const int *fd;                         /* ntasks each */
    const long long *file_offset;
    const unsigned long long *arena_offset;
    const unsigned long long *nbytes;
    const long long *first_piece;          /* ntasks + 1: task i's pieces are [first_piece[i], first_piece[i+1]) */
    const unsigned long long *piece_offset;  /* from the arena's first byte, 16-byte aligned */
    const unsigned long long *piece_nbytes;
    const CUdeviceptr *piece_out;          /* the device address of its 16-byte digest */
    void *kernel;                          /* CUfunction hash(data, nbytes, out), or NULL: no pieces */
} wc_tasks;

static CUresult (*memcpy_htod_async)(CUdeviceptr, const void *, size_t, void *);
static CUresult (*event_record)(void *, void *);
static CUresult (*event_synchronize)(void *);
static CUresult (*stream_wait_event)(void *, void *, unsigned int);
static CUresult (*launch_kernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 void *, void **, void **);
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int resolved;

static void resolve(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) return;
    memcpy_htod_async = (CUresult (*)(CUdeviceptr, const void *, size_t, void *))dlsym(lib, "cuMemcpyHtoDAsync_v2");
    event_record = (CUresult (*)(void *, void *))dlsym(lib, "cuEventRecord");
    event_synchronize = (CUresult (*)(void *))dlsym(lib, "cuEventSynchronize");
    stream_wait_event = (CUresult (*)(void *, void *, unsigned int))dlsym(lib, "cuStreamWaitEvent");
    launch_kernel = (CUresult (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                                  void **, void **))dlsym(lib, "cuLaunchKernel");
    resolved = memcpy_htod_async && event_record && event_synchronize && stream_wait_event && launch_kernel;
}

/* sizeof(wc_ring) and sizeof(wc_tasks): the binding checks them against its own layouts
 * before any call, so a library built from another version of this file is refused, not
 * written past. */
size_t wc_stage_abi(void) { return sizeof(wc_ring) * 4096 + sizeof(wc_tasks); }

/* 1 where the driver's calls were found, 0 where not. */
int wc_stage_init(void) {
    pthread_once(&once, resolve);
    return resolved;
}

int wc_stage_copy(wc_ring *r, int fd, long long file_offset, CUdeviceptr dst, size_t nbytes) {
    if (!wc_stage_init()) return WC_NO_DRIVER;
    if (r->nslots < 1 || r->nslots > WC_MAX_SLOTS || r->slot_bytes == 0) return -EINVAL;
    for (size_t done = 0; done < nbytes;) {
        int s = r->next;
        size_t n = nbytes - done < r->slot_bytes ? nbytes - done : r->slot_bytes;
        char *slot = r->buf + (size_t)s * r->slot_bytes;
        if (r->busy[s]) {
            CUresult e = event_synchronize(r->events[s]);
            if (e) return e;
            r->busy[s] = 0;
        }
        for (size_t got = 0; got < n;) {
            ssize_t m = pread(fd, slot + got, n - got, file_offset + (long long)(done + got));
            if (m < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            if (m == 0) return WC_SHORT;
            got += (size_t)m;
        }
        CUresult e = memcpy_htod_async(dst + done, slot, n, r->stream);
        if (e) return e;
        e = event_record(r->events[s], r->stream);
        r->busy[s] = 1;  /* even if the record failed: the copy was queued */
        if (e) return e;
        r->next = (s + 1) % r->nslots;
        done += n;
    }
    return 0;
}

/* Task i's hash kernels, one warp a piece (cuda_hash.py's kernel), on the ring's next
 * hash stream once the copies queued so far on its copy stream are done. */
static CUresult launch_hashes(wc_ring *r, const wc_tasks *t, long long i) {
    long long a = t->first_piece[i], b = t->first_piece[i + 1];
    if (!t->kernel || a == b) return 0;
    if (r->nhash < 1 || r->nhash > WC_MAX_HASH_STREAMS) return 1;  /* CUDA_ERROR_INVALID_VALUE */
    void *hs = r->hash_streams[r->next_hash];
    r->next_hash = (r->next_hash + 1) % r->nhash;
    CUresult e = event_record(r->copied, r->stream);
    if (!e) e = stream_wait_event(hs, r->copied, 0);
    for (long long k = a; !e && k < b; k++) {
        uint64_t data = t->base + t->piece_offset[k], n = t->piece_nbytes[k], out = t->piece_out[k];
        void *args[3] = {&data, &n, &out};
        e = launch_kernel(t->kernel, 1, 1, 1, 32, 1, 1, 0, hs, args, NULL);
    }
    return e;
}

/* Claims and runs tasks until none is left (0), `budget` bytes are done (WC_MORE), a task
 * needs more of the arena mapped (WC_NEED_ROOM: the caller grows it and calls again with
 * `resume` = *at), the table is stopped (WC_STOPPED), or one fails (its code; *at is the
 * task). `resume` is a task this thread claimed before, or -1. *done counts the bytes of
 * the tasks finished in this call. */
int wc_stage_tasks(wc_ring *r, wc_tasks *t, long long resume, unsigned long long budget, unsigned long long *done,
                   long long *at) {
    *done = 0;
    *at = -1;
    if (!wc_stage_init()) return WC_NO_DRIVER;
    for (;;) {
        long long i = resume >= 0 ? resume : __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
        resume = -1;
        if (i >= t->ntasks) return 0;
        *at = i;
        if (__atomic_load_n(&t->stop, __ATOMIC_RELAXED)) return WC_STOPPED;
        if (t->arena_offset[i] + t->nbytes[i] > __atomic_load_n(&t->mapped, __ATOMIC_ACQUIRE)) return WC_NEED_ROOM;
        int code = wc_stage_copy(r, t->fd[i], t->file_offset[i], t->base + t->arena_offset[i], t->nbytes[i]);
        if (!code) code = launch_hashes(r, t, i);
        if (code) {
            __atomic_store_n(&t->stop, 1, __ATOMIC_RELAXED);  /* the other threads claim no more */
            return code;
        }
        *done += t->nbytes[i];
        *at = -1;
        if (*done >= budget) return WC_MORE;
    }
}
