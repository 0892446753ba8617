/* kvconn._scatter: write pages' pieces into CPU pool slots with the GIL let go once.
 *
 * A page lent by a store (LMDB's map) goes into a slot as one piece per run of its kind:
 * 24 pieces for a 24-layer model in vLLM's layout. Copying them one numpy call at a time
 * gives the GIL up and wins it back for every piece, and inside an engine whose step loop
 * runs Python each win can wait for the interpreter's switch interval. scatter_pages
 * moves any number of pages (of any pools; lent, or rows of the connector's staging) with
 * one release. See kvconn/movement.py (scatter_host_pages, PageMover.host_page).
 * Pieces of 4 KiB and more are written with streaming stores (copy_piece): a scatter then
 * moves each pool byte once instead of twice (benchmarks/bench_load.py).
 *
 * The table is PageMover's: one row of four int64 per piece,
 *   [address of the piece in slot 0, bytes between slots, offset in the page, size],
 * built from the pool tensors the mover keeps alive. This module checks every piece
 * against the page's length and the slot against the pool's slot count before it copies
 * a byte; it trusts the table's addresses, which only PageMover makes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Pieces at least this long are written with non-temporal stores (where the CPU has
 * them): see copy_piece. */
#define STREAM_MIN_BYTES 4096

/* Copy one piece into the pool without reading the destination first.
 *
 * A plain memcpy of a piece this size writes through the cache: every destination line
 * is first read from memory (a read-for-ownership), so a scatter moves each pool byte
 * twice. glibc streams only copies larger than a fraction of the last-level cache,
 * which a 32 KiB piece never is. Streaming stores write whole lines straight to memory;
 * the pool's bytes are not read again until the forward pass reaches their layer, by
 * which time a load of tens of MiB has left the cache anyway. The source (the page the
 * checksum has just read) stays in cache either way.
 */
static void
copy_piece(char *dst, const char *src, size_t size)
{
#if defined(__SSE2__)
    if (size >= STREAM_MIN_BYTES) {
        size_t head = (size_t)((16 - ((uintptr_t)dst & 15)) & 15);
        memcpy(dst, src, head);
        dst += head;
        src += head;
        size -= head;
        size_t blocks = size / 64;
        for (size_t i = 0; i < blocks; i++, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        memcpy(dst, src, size % 64);
        return;
    }
#endif
    memcpy(dst, src, size);
}

/* Whether a page's table and slot are sound: every piece inside the page, the slot inside
 * the pool. -1 with an exception set if not. */
static int
check_page(const Py_buffer *page, Py_ssize_t slot, Py_ssize_t num_slots, const Py_buffer *table)
{
    if (table->len % (Py_ssize_t)(4 * sizeof(int64_t)) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "scatter table of %zd bytes is not rows of four int64", table->len);
        return -1;
    }
    if (slot < 0 || slot >= num_slots) {
        PyErr_Format(PyExc_IndexError, "slot %zd is outside the pool's %zd slots", slot,
                     num_slots);
        return -1;
    }
    const int64_t *rows = (const int64_t *)table->buf;
    Py_ssize_t pieces = table->len / (Py_ssize_t)(4 * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < pieces; i++) {
        int64_t offset = rows[4 * i + 2], size = rows[4 * i + 3];
        if (offset < 0 || size < 0 || offset > page->len || size > page->len - offset) {
            PyErr_Format(PyExc_ValueError,
                         "piece %zd (bytes %lld..%lld) lies outside a page of %zd bytes", i,
                         (long long)offset, (long long)(offset + size), page->len);
            return -1;
        }
    }
    return 0;
}

/* Copy a checked page's pieces into its slot; runs without the GIL. */
static void
copy_page(const Py_buffer *page, Py_ssize_t slot, const Py_buffer *table)
{
    const int64_t *rows = (const int64_t *)table->buf;
    Py_ssize_t pieces = table->len / (Py_ssize_t)(4 * sizeof(int64_t));
    const char *src = (const char *)page->buf;
    for (Py_ssize_t i = 0; i < pieces; i++) {
        const int64_t *row = rows + 4 * i;
        char *dst = (char *)(intptr_t)(row[0] + (int64_t)slot * row[1]);
        copy_piece(dst, src + row[2], (size_t)row[3]);
    }
}

static void
fence(void)
{
#if defined(__SSE2__)
    _mm_sfence(); /* streamed stores are weakly ordered: visible before we return */
#endif
}

/* One page of scatter_pages, held until the call ends. */
typedef struct {
    Py_buffer page, table;
    Py_ssize_t slot;
} Job;

static PyObject *
scatter_pages(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *seq = PySequence_Fast(arg, "scatter_pages takes a sequence of pages");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), held = 0;
    Job *jobs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Job));
    PyObject *result = NULL;
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++) {
        Job *job = &jobs[held];
        Py_ssize_t num_slots;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, held);
        if (!PyTuple_Check(item)) {
            PyErr_Format(PyExc_TypeError,
                         "page %zd of scatter_pages is not a (page, slot, num_slots, table) tuple",
                         held);
            goto done;
        }
        if (!PyArg_ParseTuple(item, "y*nny*", &job->page, &job->slot, &num_slots,
                              &job->table)) {
            goto done;
        }
        if (check_page(&job->page, job->slot, num_slots, &job->table) < 0) {
            held++; /* its buffers are held: release them too */
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        copy_page(&jobs[i].page, jobs[i].slot, &jobs[i].table);
    }
    fence();
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t i = 0; jobs != NULL && i < held; i++) {
        PyBuffer_Release(&jobs[i].page);
        PyBuffer_Release(&jobs[i].table);
    }
    PyMem_Free(jobs);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"scatter_pages", scatter_pages, METH_O,
     "scatter_pages(pages): copy each (page, slot, num_slots, table)'s pieces into its "
     "pool slot."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvconn._scatter", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__scatter(void)
{
    return PyModule_Create(&module);
}
