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
 * Returns 0; > 0, the CUresult of the driver call that failed; < 0, -errno of a failed
 * pread; WC_SHORT where the file ended before nbytes (truncated under the load). The ring
 * stays consistent after an error: every slot whose copy was queued is marked busy.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <unistd.h>

#define WC_MAX_SLOTS 16
#define WC_SHORT (-1000000)
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
} wc_ring;

static CUresult (*memcpy_htod_async)(CUdeviceptr, const void *, size_t, void *);
static CUresult (*event_record)(void *, void *);
static CUresult (*event_synchronize)(void *);
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int resolved;

static void resolve(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) return;
    memcpy_htod_async = (CUresult (*)(CUdeviceptr, const void *, size_t, void *))dlsym(lib, "cuMemcpyHtoDAsync_v2");
    event_record = (CUresult (*)(void *, void *))dlsym(lib, "cuEventRecord");
    event_synchronize = (CUresult (*)(void *))dlsym(lib, "cuEventSynchronize");
    resolved = memcpy_htod_async && event_record && event_synchronize;
}

/* sizeof(wc_ring): the binding checks it against its own layout before any call, so a
 * library built from another version of this file is refused, not written past. */
size_t wc_stage_abi(void) { return sizeof(wc_ring); }

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
