/* Lossless JPEG preparation: restart markers that tile the MCU grid, the way jpegtran writes them.
 *
 * add_restart_markers() reads the DCT coefficients (no decode to pixels), writes them back as a
 * sequential Huffman JPEG with a restart marker every `rows` MCU rows (or, with `mcus`, every few
 * MCUs, a divisor of the MCU row so the intervals tile it) and optimized Huffman tables, and
 * copies every APPn and COM marker: the same coefficients, so the same decoded pixels. The
 * decode kernel (_jpegroi.c) can then start at the restart interval just above a crop (and, with
 * tiles, just left of it) instead of Huffman-decoding every row above it. A progressive file comes out sequential
 * (the same coefficients); an arithmetic-coded one comes out Huffman-coded.
 *
 * Strict (_jpegshared.h): every libjpeg warning (truncated or corrupt data) is an error, never
 * a file with grey rows. The header's size is checked against a pixel limit before the
 * coefficients are read. The work runs without the GIL and touches no Python object; the
 * output buffer is ours (not jpeg_mem_dest's), so an error half-way frees it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>
#include <jerror.h>

#include "_jpegshared.h"

#define DEFAULT_MAX_PIXELS 178956970ULL /* as loader_service.decode.jpeg.DEFAULT_MAX_PIXELS */
#define MAX_RESTART_INTERVAL 65535U    /* the DRI field is 16 bits */

/* A growing output buffer that the caller frees whatever happened (jpeg_mem_dest's buffer
 * leaks, or dangles, when an error longjmps out after it grew). */
struct grow_dest {
    struct jpeg_destination_mgr pub;
    unsigned char *buf;
    size_t cap, len;
};

static void dest_init(j_compress_ptr c)
{
    struct grow_dest *d = (struct grow_dest *)c->dest;
    d->buf = malloc(d->cap);
    if (d->buf == NULL)
        ERREXIT1(c, JERR_OUT_OF_MEMORY, 1);
    d->pub.next_output_byte = d->buf;
    d->pub.free_in_buffer = d->cap;
}

static boolean dest_empty(j_compress_ptr c)
{
    /* called when the whole buffer is full */
    struct grow_dest *d = (struct grow_dest *)c->dest;
    unsigned char *bigger = realloc(d->buf, d->cap * 2);
    if (bigger == NULL)
        ERREXIT1(c, JERR_OUT_OF_MEMORY, 2);
    d->buf = bigger;
    d->pub.next_output_byte = bigger + d->cap;
    d->pub.free_in_buffer = d->cap;
    d->cap *= 2;
    return TRUE;
}

static void dest_term(j_compress_ptr c)
{
    struct grow_dest *d = (struct grow_dest *)c->dest;
    d->len = d->cap - d->pub.free_in_buffer;
}

/* 1234567 -> "1,234,567" (the same spelling as the Python side's messages) */
static void grouped(unsigned long long v, char *out, size_t n)
{
    char digits[32];
    int len = snprintf(digits, sizeof digits, "%llu", v);
    size_t o = 0;
    for (int i = 0; i < len && o + 2 < n; i++) {
        if (i > 0 && (len - i) % 3 == 0)
            out[o++] = ',';
        out[o++] = digits[i];
    }
    out[o] = 0;
}

static int is_jfif_app0(jpeg_saved_marker_ptr m)
{
    return m->marker == JPEG_APP0 && m->data_length >= 5 && memcmp(m->data, "JFIF\0", 5) == 0;
}

static int is_adobe_app14(jpeg_saved_marker_ptr m)
{
    return m->marker == JPEG_APP0 + 14 && m->data_length >= 5 && memcmp(m->data, "Adobe", 5) == 0;
}

struct job {
    const unsigned char *data;
    size_t size;
    int rows, mcus;
    unsigned long long max_pixels;
    unsigned char *out; /* malloc'd; the caller frees it */
    size_t out_len;
    char msg[JMSG_LENGTH_MAX + 160];
};

static int run_prepare(struct job *jb)
{
    struct jpeg_decompress_struct src;
    struct jpeg_compress_struct dst;
    struct strict_err err; /* shared, as in jpegtran: either side's error lands here */
    struct grow_dest dest;
    int ok = 0;

    memset(&dest, 0, sizeof dest);
    src.err = strict_err_init(&err);
    jpeg_create_decompress(&src);
    dst.err = &err.pub;
    jpeg_create_compress(&dst);
    if (setjmp(err.jb)) {
        snprintf(jb->msg, sizeof jb->msg, "%s", err.msg);
        goto done;
    }
    jpeg_mem_src(&src, jb->data, (unsigned long)jb->size);
    jpeg_save_markers(&src, JPEG_COM, 0xFFFF);
    for (int m = 0; m < 16; m++)
        jpeg_save_markers(&src, JPEG_APP0 + m, 0xFFFF);
    jpeg_read_header(&src, TRUE);
    unsigned long long pixels = (unsigned long long)src.image_width * src.image_height;
    if (pixels > jb->max_pixels) {
        char p[32], lim[32];
        grouped(pixels, p, sizeof p);
        grouped(jb->max_pixels, lim, sizeof lim);
        snprintf(jb->msg, sizeof jb->msg, "image is %ux%u = %s pixels, above the limit of %s (max_pixels)",
                 src.image_width, src.image_height, p, lim);
        goto done;
    }
    unsigned int per_row = mcus_per_row(&src), tile = 0;
    if (jb->mcus > 0) {
        /* the largest divisor of the row's MCU count in [mcus/2, mcus], so that the intervals tile
         * every MCU row; whole rows when there is none (a prime count: one marker per MCU would
         * cost ~2.5 bytes each) */
        for (unsigned int k = (unsigned int)jb->mcus; k >= 1 && 2 * k >= (unsigned int)jb->mcus && tile == 0; k--)
            if (per_row % k == 0)
                tile = k;
        if (tile == 0)
            tile = per_row;
    }
    unsigned long long interval = (unsigned long long)jb->rows * per_row;
    if (tile == 0 && interval > MAX_RESTART_INTERVAL) {
        snprintf(jb->msg, sizeof jb->msg, "%d MCU rows of %u MCUs exceed the largest restart interval (%u MCUs)",
                 jb->rows, per_row, MAX_RESTART_INTERVAL);
        goto done;
    }
    jvirt_barray_ptr *coefs = jpeg_read_coefficients(&src); /* reads the whole file */
    jpeg_copy_critical_parameters(&src, &dst); /* sequential Huffman unless told otherwise */
    dst.optimize_coding = TRUE;
    dst.restart_interval = tile; /* 0: by rows */
    dst.restart_in_rows = tile ? 0 : jb->rows;
    dest.pub.init_destination = dest_init;
    dest.pub.empty_output_buffer = dest_empty;
    dest.pub.term_destination = dest_term;
    dest.cap = jb->size + jb->size / 8 + 4096; /* usually enough: optimized tables, a few RST markers */
    dst.dest = &dest.pub;
    jpeg_write_coefficients(&dst, coefs); /* writes SOI and the library's own JFIF or Adobe marker */
    for (jpeg_saved_marker_ptr m = src.marker_list; m != NULL; m = m->next) {
        /* as jpegtran's jcopy_markers_execute: not a second JFIF/Adobe marker */
        if ((dst.write_JFIF_header && is_jfif_app0(m)) || (dst.write_Adobe_marker && is_adobe_app14(m)))
            continue;
        jpeg_write_marker(&dst, m->marker, m->data, m->data_length);
    }
    jpeg_finish_compress(&dst);
    jpeg_finish_decompress(&src); /* after the compressor: it frees the coefficient arrays */
    jb->out = dest.buf;
    jb->out_len = dest.len;
    dest.buf = NULL;
    ok = 1;
done:
    jpeg_destroy_compress(&dst);
    jpeg_destroy_decompress(&src);
    free(dest.buf);
    return ok;
}

static PyObject *py_add_restart_markers(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"data", "rows", "max_pixels", "mcus", NULL};
    Py_buffer data;
    struct job jb;
    long long max_pixels = (long long)DEFAULT_MAX_PIXELS;
    memset(&jb, 0, sizeof jb);
    jb.rows = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|iLi", kwlist, &data, &jb.rows, &max_pixels, &jb.mcus))
        return NULL;
    if (jb.mcus < 0 || jb.mcus > (int)MAX_RESTART_INTERVAL || (jb.mcus > 0 && jb.rows != 1)) {
        PyErr_Format(PyExc_ValueError, "mcus must be 0 (whole rows) or 1..%u, with rows=1; got mcus=%d, rows=%d",
                     MAX_RESTART_INTERVAL, jb.mcus, jb.rows);
        PyBuffer_Release(&data);
        return NULL;
    }
    if (jb.rows < 1 || jb.rows > (int)MAX_RESTART_INTERVAL) {
        PyErr_Format(PyExc_ValueError, "rows must be 1..%u, got %d", MAX_RESTART_INTERVAL, jb.rows);
        PyBuffer_Release(&data);
        return NULL;
    }
    if (max_pixels < 1) {
        PyErr_Format(PyExc_ValueError, "max_pixels must be >= 1, got %lld", max_pixels);
        PyBuffer_Release(&data);
        return NULL;
    }
    jb.data = data.buf;
    jb.size = (size_t)data.len;
    jb.max_pixels = (unsigned long long)max_pixels;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = run_prepare(&jb);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, jb.msg);
        return NULL;
    }
    PyObject *res = PyBytes_FromStringAndSize((const char *)jb.out, (Py_ssize_t)jb.out_len);
    free(jb.out);
    return res;
}

static PyMethodDef methods[] = {
    {"add_restart_markers", (PyCFunction)(void (*)(void))py_add_restart_markers, METH_VARARGS | METH_KEYWORDS,
     "add_restart_markers(data, rows=1, max_pixels=178956970, mcus=0) -> bytes: the JPEG losslessly rewritten as "
     "sequential Huffman with a restart marker every `rows` MCU rows (mcus > 0: every d MCUs, d the largest "
     "divisor of the MCU row's count in [mcus/2, mcus], else whole rows), optimized Huffman tables and every "
     "APPn/COM marker kept. Raises ValueError with the reason (corrupt, truncated, above max_pixels)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegprep", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpegprep(void)
{
    return PyModule_Create(&module);
}
