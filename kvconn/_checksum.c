/* kvconn._checksum: seal and verify many pages' xxh3-64 trailers with the GIL let go once.
 *
 * A page's trailer is the big-endian xxh3-64 of its payload, seeded by the xxh3-64 of its
 * key (kvconn/integrity.py). The xxhash package computes one digest per call and lets the
 * GIL go for each one above 64 KiB, so a 63-page load gave the GIL up 63 times just for
 * its checksums; beside an engine thread that runs Python, each win back can wait up to
 * the interpreter's switch interval (benchmarks/bench_load.py --hog). Here a whole batch
 * is hashed in one call.
 *
 * The hash itself is not in this file: xxh3's code is the reference library's, which the
 * xxhash package already carries (its extension exports XXH3_64bits_withSeed) and many
 * systems ship (libxxhash.so.0). bind() resolves that one function at run time from a
 * library the caller names; kvconn.integrity checks the bound function against the
 * package's own digests before it uses it, and keeps to the package otherwise. So this
 * module builds with no xxhash headers and can never disagree with the trailers that the
 * package writes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#define TRAILER 8

typedef uint64_t (*xxh3_fn)(const void *data, size_t len, uint64_t seed);

static xxh3_fn xxh3 = NULL;

static PyObject *
bind(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) {
        return NULL;
    }
    /* Never closed: the bound function lives in it for as long as the process. */
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    void *fn = lib != NULL ? dlsym(lib, "XXH3_64bits_withSeed") : NULL;
    if (fn == NULL) {
        if (lib != NULL) {
            dlclose(lib);
        }
        Py_RETURN_FALSE;
    }
    xxh3 = (xxh3_fn)fn;
    Py_RETURN_TRUE;
}

static PyObject *
unbind(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    xxh3 = NULL;
    Py_RETURN_NONE;
}

static int
require_bound(void)
{
    if (xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvconn._checksum has no xxh3 bound (bind())");
        return -1;
    }
    return 0;
}

static PyObject *
digest(PyObject *self, PyObject *args)
{
    Py_buffer data;
    unsigned long long seed;
    (void)self;
    if (require_bound() < 0 || !PyArg_ParseTuple(args, "y*K", &data, &seed)) {
        return NULL;
    }
    uint64_t h = xxh3(data.buf, (size_t)data.len, (uint64_t)seed);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
}

/* One page of a batch: its bytes and its key's UTF-8. */
typedef struct {
    Py_buffer value;
    const char *key;
    Py_ssize_t key_len;
} Item;

/* A call's pages, held from open_batch to close_batch: the value buffers, and the keys'
 * sequence, which keeps the str objects whose cached UTF-8 the items point into. */
typedef struct {
    Item *items;
    Py_ssize_t n, held;
    PyObject *keys;
} Batch;

static void
close_batch(Batch *batch)
{
    for (Py_ssize_t i = 0; i < batch->held; i++) {
        PyBuffer_Release(&batch->items[i].value);
    }
    PyMem_Free(batch->items);
    Py_XDECREF(batch->keys);
}

/* Parse (values, keys) and take hold of every value (writable ones to seal) and key.
 * -1 with an exception set if any is not what the batch needs; the batch is closed
 * either way only by close_batch. */
static int
open_batch(PyObject *args, int flags, Batch *batch)
{
    PyObject *values_arg, *keys_arg;
    memset(batch, 0, sizeof(*batch));
    if (require_bound() < 0 || !PyArg_ParseTuple(args, "OO", &values_arg, &keys_arg)) {
        return -1;
    }
    batch->keys = PySequence_Fast(keys_arg, "keys must be a sequence");
    if (batch->keys == NULL) {
        return -1;
    }
    PyObject *values = PySequence_Fast(values_arg, "values must be a sequence");
    if (values == NULL) {
        return -1;
    }
    int rc = -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
    if (PySequence_Fast_GET_SIZE(batch->keys) != n) {
        PyErr_Format(PyExc_ValueError, "%zd values but %zd keys", n,
                     PySequence_Fast_GET_SIZE(batch->keys));
        goto done;
    }
    batch->items = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Item));
    if (batch->items == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    batch->n = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        Item *item = &batch->items[i];
        PyObject *key = PySequence_Fast_GET_ITEM(batch->keys, i);
        if (!PyUnicode_Check(key)) {
            PyErr_Format(PyExc_TypeError, "key %zd is not a str", i);
            goto done;
        }
        item->key = PyUnicode_AsUTF8AndSize(key, &item->key_len);
        if (item->key == NULL ||
            PyObject_GetBuffer(PySequence_Fast_GET_ITEM(values, i), &item->value, flags) < 0) {
            goto done;
        }
        batch->held = i + 1;
        if (!PyBuffer_IsContiguous(&item->value, 'C')) {
            PyErr_Format(PyExc_ValueError, "value %zd is not contiguous", i);
            goto done;
        }
    }
    rc = 0;
done:
    Py_DECREF(values); /* the buffers hold their exporters */
    return rc;
}

static uint64_t
trailer_of(const Item *item)
{
    uint64_t seed = xxh3(item->key, (size_t)item->key_len, 0);
    return xxh3(item->value.buf, (size_t)(item->value.len - TRAILER), seed);
}

static PyObject *
seal(PyObject *self, PyObject *args)
{
    Batch batch;
    (void)self;
    PyObject *result = NULL;
    if (open_batch(args, PyBUF_WRITABLE, &batch) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < batch.n; i++) {
        if (batch.items[i].value.len < TRAILER) {
            PyErr_Format(PyExc_ValueError, "value %zd has %zd bytes, no room for a trailer", i,
                         batch.items[i].value.len);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < batch.n; i++) {
        const Item *item = &batch.items[i];
        uint64_t h = trailer_of(item);
        unsigned char *end = (unsigned char *)item->value.buf + item->value.len - TRAILER;
        for (int b = 0; b < TRAILER; b++) {
            end[b] = (unsigned char)(h >> (8 * (TRAILER - 1 - b)));
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    close_batch(&batch);
    return result;
}

static PyObject *
verify(PyObject *self, PyObject *args)
{
    Batch batch;
    (void)self;
    PyObject *result = NULL;
    char *ok = NULL;
    if (open_batch(args, PyBUF_SIMPLE, &batch) < 0) {
        goto done;
    }
    ok = PyMem_Calloc(batch.n > 0 ? (size_t)batch.n : 1, 1);
    if (ok == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < batch.n; i++) {
        const Item *item = &batch.items[i];
        if (item->value.len < TRAILER) {
            continue; /* no trailer: cannot pass */
        }
        const unsigned char *end =
            (const unsigned char *)item->value.buf + item->value.len - TRAILER;
        uint64_t stored = 0;
        for (int b = 0; b < TRAILER; b++) {
            stored = (stored << 8) | end[b];
        }
        ok[i] = stored == trailer_of(item);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(batch.n);
    for (Py_ssize_t i = 0; result != NULL && i < batch.n; i++) {
        PyObject *flag = ok[i] ? Py_True : Py_False;
        Py_INCREF(flag);
        PyList_SET_ITEM(result, i, flag);
    }
done:
    PyMem_Free(ok);
    close_batch(&batch);
    return result;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O,
     "bind(path): resolve XXH3_64bits_withSeed from the library at path; whether found."},
    {"unbind", unbind, METH_NOARGS, "unbind(): forget the bound function."},
    {"digest", digest, METH_VARARGS, "digest(data, seed): xxh3-64 of data, as an int."},
    {"seal", seal, METH_VARARGS,
     "seal(values, keys): write each value's trailer (its last 8 bytes) for its key."},
    {"verify", verify, METH_VARARGS,
     "verify(values, keys): per value, whether its trailer matches its payload and key."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvconn._checksum", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__checksum(void)
{
    return PyModule_Create(&module);
}
