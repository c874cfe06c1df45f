/* Fused crop + power-of-two scaled JPEG decode against the system libjpeg-turbo.
 *
 * decode() decodes only the rows and columns a crop needs: jpeg_crop_scanline narrows each
 * scanline to the iMCU columns around the crop, jpeg_skip_scanlines skips the rows above it,
 * and rows below it are not decoded at all (when the file ends with its EOI marker; without
 * one the rest is read so that a truncated file is an error). Scale 1/1, 1/2, 1/4 or 1/8 in
 * the DCT domain, the only factors that are faster than a full decode in libjpeg-turbo.
 *
 * Restart markers: when a baseline file's restart intervals tile the MCU grid (several per MCU
 * row, or whole rows; `loader-service prepare-jpegs` writes them), the rows above the crop and
 * the columns beside it are not even entropy-decoded: the decoder reads a smaller JPEG made of
 * the header and just the restart segments around the crop (restart_tiles). The decoded blocks
 * are the same (DC prediction restarts at every marker), so are the pixels.
 *
 * Strict like simplejpeg's strict=True: every libjpeg warning ("premature end of data
 * segment", "corrupt JPEG data") is an error, never grey or garbage pixels. The decode runs
 * without the GIL and touches no Python object; errors come back as the library's message.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

#include "_jpegshared.h"

#define FLAG_FASTDCT 1
#define FLAG_FASTUPSAMPLE 2
#define CHUNK 16
#define MAX_CHUNK 16
#define MARGIN 16 /* pixels around the crop decoded for context (two 4:2:0 iMCUs at 1/2) */

/* Does the file end with an EOI marker (allowing a little padding after it)? */
static int has_eoi(const unsigned char *p, size_t n)
{
    size_t i = n, floor = n > 4096 ? n - 4096 : 0;
    while (i > floor && (p[i - 1] == 0 || p[i - 1] == ' ' || p[i - 1] == '\n' || p[i - 1] == '\r'))
        i--;
    return i >= 2 && p[i - 2] == 0xFF && p[i - 1] == 0xD9;
}

static int is_cmyk(J_COLOR_SPACE cs) { return cs == JCS_CMYK || cs == JCS_YCCK; }

/* OpenCV's CMYK -> RGB (icvCvt_CMYK2BGR_8u_C4C3R), so a CMYK JPEG gives the pixels it gave
 * when OpenCV decoded it. */
static void cmyk_to_rgb(const unsigned char *src, unsigned char *dst, JDIMENSION n)
{
    for (JDIMENSION i = 0; i < n; i++, src += 4, dst += 3) {
        int c = src[0], m = src[1], y = src[2], k = src[3];
        dst[0] = (unsigned char)(k - ((255 - c) * k >> 8));
        dst[1] = (unsigned char)(k - ((255 - m) * k >> 8));
        dst[2] = (unsigned char)(k - ((255 - y) * k >> 8));
    }
}

/* Offset of the SOF marker (its 0xFF) in the header, or 0 when the markers do not walk cleanly
 * up to SOS within `end` bytes. */
static size_t find_sof(const unsigned char *p, size_t end)
{
    size_t i = 2, sof = 0;
    while (i + 4 <= end) {
        if (p[i] != 0xFF)
            return 0;
        if (p[i + 1] == 0xFF) { /* fill byte */
            i++;
            continue;
        }
        unsigned m = p[i + 1];
        if (m == 0x01 || (m >= 0xD0 && m <= 0xD8)) { /* standalone markers */
            i += 2;
            continue;
        }
        size_t len = ((size_t)p[i + 2] << 8) | p[i + 3];
        if (len < 2)
            return 0;
        if (m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC)
            sof = i;
        if (m == 0xDA)
            return sof;
        i += 2 + len;
    }
    return 0;
}

/* Where the first n restart segments of the scan that starts at `start` begin and end (each ends
 * at the marker after it). 1 when all n are there with their restart markers in sequence; 0
 * otherwise (fewer segments, a marker out of sequence, no marker after the n-th). */
static int find_segments(const unsigned char *p, size_t start, size_t size, size_t n, size_t *begin, size_t *end)
{
    size_t i = start, k = 0;
    begin[0] = start;
    while (k < n) {
        const unsigned char *f = memchr(p + i, 0xFF, size - i);
        if (f == NULL || (size_t)(f - p) + 1 >= size)
            return 0;
        i = (size_t)(f - p);
        unsigned m = p[i + 1];
        if (m == 0x00 || m == 0xFF) { /* a stuffed 0xFF in the data, or a fill byte */
            i += 1 + (m == 0x00);
            continue;
        }
        end[k] = i;
        if (m >= 0xD0 && m <= 0xD7) {
            if (m - 0xD0 != k % 8)
                return 0;
        } else if (k + 1 < n) { /* the scan ended (EOI or another marker) before segment n */
            return 0;
        }
        k++;
        if (k < n)
            begin[k] = i + 2;
        i += 2;
    }
    return 1;
}

/* A smaller JPEG holding only the restart segments that cover image rows [ry0, ry1) and columns
 * [rx0, rx1): the header with a new height and width, then those segments' scan data with
 * renumbered restart markers. Each segment decodes on its own (DC prediction restarts at every
 * marker), so every block of the smaller image equals the original's. Possible in a baseline
 * scan whose restart intervals tile the MCU grid: several per MCU row, or whole MCU rows.
 * Returns the new JPEG (malloc'd; *len its size, *top and *left where it sits in the image) or
 * NULL when the file does not allow it or nothing would be left out. */
static unsigned char *restart_tiles(struct jpeg_decompress_struct *c, const unsigned char *p, size_t size,
                                    JDIMENSION ry0, JDIMENSION ry1, JDIMENSION rx0, JDIMENSION rx1,
                                    size_t *len, JDIMENSION *top, JDIMENSION *left)
{
    if (c->progressive_mode || c->arith_code || c->restart_interval == 0 || c->comps_in_scan != c->num_components)
        return NULL;
    if (c->num_components == 1 && (c->comp_info[0].h_samp_factor != c->max_h_samp_factor ||
                                   c->comp_info[0].v_samp_factor != c->max_v_samp_factor))
        return NULL; /* its one-block MCU would not be 8x8 image pixels */
    size_t mw = mcu_width(c), mh = mcu_height(c); /* in image pixels */
    size_t per_row = mcus_per_row(c), rows = (c->image_height + mh - 1) / mh;
    size_t ri = c->restart_interval, cols, tall; /* segments per MCU row; MCU rows per segment row */
    if (per_row % ri == 0) {
        cols = per_row / ri;
        tall = 1;
    } else if (ri % per_row == 0) {
        cols = 1;
        tall = ri / per_row;
    } else {
        return NULL;
    }
    size_t seg_rows = (rows + tall - 1) / tall, seg_w = cols > 1 ? ri * mw : c->image_width;
    size_t g0 = ry0 / mh / tall, g1 = ((ry1 + mh - 1) / mh + tall - 1) / tall;
    size_t c0 = rx0 / seg_w, c1 = (rx1 + seg_w - 1) / seg_w;
    if (g1 > seg_rows)
        g1 = seg_rows;
    if (c1 > cols)
        c1 = cols;
    if (g0 >= g1 || c0 >= c1 || (g0 == 0 && c0 == 0 && c1 == cols))
        return NULL; /* nothing above or beside the region: the plain path stops after it anyway */
    size_t scan_start = (size_t)(c->src->next_input_byte - p), sof = find_sof(p, scan_start), need = g1 * cols;
    if (sof == 0 || sof + 9 > scan_start)
        return NULL;
    size_t *begin = malloc(2 * need * sizeof *begin), *end = begin + need;
    unsigned char *out = NULL;
    if (begin == NULL || !find_segments(p, scan_start, size, need, begin, end))
        goto done;
    size_t total = scan_start + 2;
    for (size_t g = g0; g < g1; g++)
        for (size_t k = g * cols + c0; k < g * cols + c1; k++)
            total += end[k] - begin[k] + 2;
    out = malloc(total);
    if (out == NULL)
        goto done;
    memcpy(out, p, scan_start);
    size_t h = g1 == seg_rows ? c->image_height - g0 * tall * mh : (g1 - g0) * tall * mh;
    size_t w = c1 == cols ? c->image_width - c0 * seg_w : (c1 - c0) * seg_w;
    out[sof + 5] = (unsigned char)(h >> 8);
    out[sof + 6] = (unsigned char)(h & 0xFF);
    out[sof + 7] = (unsigned char)(w >> 8);
    out[sof + 8] = (unsigned char)(w & 0xFF);
    size_t o = scan_start, n = 0, last = (g1 - g0) * (c1 - c0);
    for (size_t g = g0; g < g1; g++) {
        for (size_t k = g * cols + c0; k < g * cols + c1; k++) {
            memcpy(out + o, p + begin[k], end[k] - begin[k]);
            o += end[k] - begin[k];
            if (++n < last) {
                out[o++] = 0xFF;
                out[o++] = (unsigned char)(0xD0 + (n - 1) % 8);
            }
        }
    }
    out[o++] = 0xFF;
    out[o++] = 0xD9;
    *len = o;
    *top = (JDIMENSION)(g0 * tall * mh);
    *left = (JDIMENSION)(c0 * seg_w);
done:
    free(begin);
    return out;
}

struct job {
    const unsigned char *data;
    size_t size;
    int denom, flags;
    JDIMENSION y0, x0, h, w;
    unsigned char *out;
    char msg[JMSG_LENGTH_MAX + 64];
};

static int run_decode(struct job *jb)
{
    struct jpeg_decompress_struct cinfo;
    struct strict_err err;
    unsigned char *volatile row = NULL;
    unsigned char *volatile tiles = NULL;
    int ok = 0;

    cinfo.err = strict_err_init(&err);
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.jb)) {
        snprintf(jb->msg, sizeof jb->msg, "%s", err.msg);
        goto done;
    }
    jpeg_mem_src(&cinfo, jb->data, (unsigned long)jb->size);
    jpeg_read_header(&cinfo, TRUE);
    /* Decode only the restart segments around the crop when the file has them (see
     * restart_tiles); not when the EOI is missing: a truncated file must fail as a whole. */
    JDIMENSION above = 0, beside = 0, d = (JDIMENSION)jb->denom;
    int eoi = has_eoi(jb->data, jb->size);
    if (eoi) {
        JDIMENSION ry0 = (jb->y0 > MARGIN ? jb->y0 - MARGIN : 0) * d, rx0 = (jb->x0 > MARGIN ? jb->x0 - MARGIN : 0) * d;
        JDIMENSION ry1 = (jb->y0 + jb->h + MARGIN) * d, rx1 = (jb->x0 + jb->w + MARGIN) * d;
        size_t len = 0;
        JDIMENSION top = 0, left = 0;
        unsigned char *t = restart_tiles(&cinfo, jb->data, jb->size, ry0, ry1 < cinfo.image_height ? ry1 : cinfo.image_height,
                                         rx0, rx1 < cinfo.image_width ? rx1 : cinfo.image_width, &len, &top, &left);
        if (t != NULL) {
            tiles = t;
            jpeg_abort_decompress(&cinfo);
            jpeg_mem_src(&cinfo, t, (unsigned long)len);
            jpeg_read_header(&cinfo, TRUE);
            above = top / d;
            beside = left / d;
        }
    }
    JDIMENSION y0 = jb->y0 - above, x0 = jb->x0 - beside;
    int cmyk = is_cmyk(cinfo.jpeg_color_space);
    cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)jb->denom;
    cinfo.dct_method = (jb->flags & FLAG_FASTDCT) ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = (jb->flags & FLAG_FASTUPSAMPLE) ? FALSE : TRUE;
    jpeg_start_decompress(&cinfo);
    if (jb->h == 0 || jb->w == 0 || y0 + jb->h > cinfo.output_height || x0 + jb->w > cinfo.output_width) {
        snprintf(jb->msg, sizeof jb->msg, "crop %ux%u at (%u, %u) is outside the %ux%u image at 1/%d",
                 jb->w, jb->h, jb->x0, jb->y0, cinfo.output_width + beside, cinfo.output_height + above, jb->denom);
        goto done;
    }
    /* Fancy (smooth) chroma upsampling reads the neighbours of each chroma sample, and the decoder
     * treats the edge of a cropped or skipped region as the image's edge: ask for MARGIN more
     * pixels on every side (where there are any) so the crop's own pixels have their real
     * neighbours and equal those of a full decode. */
    JDIMENSION ex0 = x0 > MARGIN ? x0 - MARGIN : 0;
    JDIMENSION ex1 = x0 + jb->w + MARGIN < cinfo.output_width ? x0 + jb->w + MARGIN : cinfo.output_width;
    JDIMENSION ey0 = y0 > MARGIN ? y0 - MARGIN : 0;
    JDIMENSION xoff = ex0, cw = ex1 - ex0;
    if (xoff > 0 || cw < cinfo.output_width)
        jpeg_crop_scanline(&cinfo, &xoff, &cw); /* widens to iMCU boundaries: xoff <= ex0, xoff + cw >= ex1 */
    int nc = cinfo.output_components;
    /* read up to CHUNK rows per call: one row at a time costs ~15 % more on small images */
    JDIMENSION chunk = cinfo.rec_outbuf_height > CHUNK ? (JDIMENSION)cinfo.rec_outbuf_height : CHUNK;
    size_t pitch = (size_t)cinfo.output_width * nc;
    row = malloc(pitch * chunk);
    if (row == NULL) {
        snprintf(jb->msg, sizeof jb->msg, "out of memory for %u scanlines", chunk);
        goto done;
    }
    size_t skip = (size_t)(x0 - xoff) * nc, line = (size_t)jb->w * 3;
    JSAMPROW rows[MAX_CHUNK];
    for (JDIMENSION i = 0; i < chunk; i++)
        rows[i] = row + i * pitch;
    if (ey0 > 0 && jpeg_skip_scanlines(&cinfo, ey0) != ey0) {
        snprintf(jb->msg, sizeof jb->msg, "could not skip to row %u", ey0 + above);
        goto done;
    }
    while (cinfo.output_scanline < y0) { /* the margin above the crop: decoded, not kept */
        JDIMENSION want = y0 - cinfo.output_scanline < chunk ? y0 - cinfo.output_scanline : chunk;
        if (jpeg_read_scanlines(&cinfo, rows, want) == 0) {
            snprintf(jb->msg, sizeof jb->msg, "decoder returned no scanline at row %u", cinfo.output_scanline + above);
            goto done;
        }
    }
    JDIMENSION r = 0;
    while (r < jb->h) {
        JDIMENSION want = jb->h - r < chunk ? jb->h - r : chunk;
        JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, want);
        if (got == 0) {
            snprintf(jb->msg, sizeof jb->msg, "decoder returned no scanline at row %u", jb->y0 + r);
            goto done;
        }
        for (JDIMENSION i = 0; i < got; i++, r++) {
            if (cmyk)
                cmyk_to_rgb(rows[i] + skip, jb->out + r * line, jb->w);
            else
                memcpy(jb->out + r * line, rows[i] + skip, line);
        }
    }
    if (cinfo.output_scanline < cinfo.output_height && !eoi) {
        /* No EOI at the end: probably truncated; decode to the end so the library can tell. Not
         * by skipping to the very end: that returns at once, reading nothing. */
        JDIMENSION left = cinfo.output_height - cinfo.output_scanline;
        if (left > 1)
            jpeg_skip_scanlines(&cinfo, left - 1);
        while (cinfo.output_scanline < cinfo.output_height)
            jpeg_read_scanlines(&cinfo, rows, 1);
    }
    if (cinfo.output_scanline == cinfo.output_height)
        jpeg_finish_decompress(&cinfo);
    ok = 1;
done:
    free(row);
    jpeg_destroy_decompress(&cinfo);
    free(tiles);
    return ok;
}

static PyObject *py_decode(PyObject *self, PyObject *args)
{
    Py_buffer data, out;
    struct job jb;
    unsigned int y0, x0, h, w;
    if (!PyArg_ParseTuple(args, "y*iIIIIw*i", &data, &jb.denom, &y0, &x0, &h, &w, &out, &jb.flags))
        return NULL;
    if (jb.denom != 1 && jb.denom != 2 && jb.denom != 4 && jb.denom != 8) {
        PyErr_Format(PyExc_ValueError, "scale denominator must be 1, 2, 4 or 8, got %d", jb.denom);
        goto fail;
    }
    if (!PyBuffer_IsContiguous(&out, 'C') || (size_t)out.len != (size_t)h * w * 3) {
        PyErr_Format(PyExc_ValueError, "output buffer must be C-contiguous with %zu bytes, got %zd",
                     (size_t)h * w * 3, out.len);
        goto fail;
    }
    jb.data = data.buf;
    jb.size = (size_t)data.len;
    jb.y0 = y0; jb.x0 = x0; jb.h = h; jb.w = w;
    jb.out = out.buf;
    jb.msg[0] = 0;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = run_decode(&jb);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, jb.msg);
        return NULL;
    }
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return NULL;
}

/* header(data) -> (height, width, components, cmyk, progressive, restart_interval); reads the
 * markers only. */
static PyObject *py_header(PyObject *self, PyObject *args)
{
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    struct jpeg_decompress_struct cinfo;
    struct strict_err err;
    PyObject *res = NULL;
    cinfo.err = strict_err_init(&err);
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.jb)) {
        PyErr_SetString(PyExc_ValueError, err.msg);
        goto done;
    }
    jpeg_mem_src(&cinfo, data.buf, (unsigned long)data.len);
    jpeg_read_header(&cinfo, TRUE);
    res = Py_BuildValue("(IIiiiI)", cinfo.image_height, cinfo.image_width, cinfo.num_components,
                        is_cmyk(cinfo.jpeg_color_space), (int)cinfo.progressive_mode, cinfo.restart_interval);
done:
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    return res;
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS,
     "decode(data, denom, y0, x0, h, w, out, flags): the h x w RGB crop at (y0, x0) of the image "
     "decoded at 1/denom, written into out (h*w*3 bytes). Raises ValueError with the reason."},
    {"header", py_header, METH_VARARGS,
     "header(data) -> (height, width, components, cmyk, progressive, restart_interval)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegroi", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpegroi(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyModule_AddIntConstant(m, "FASTDCT", FLAG_FASTDCT);
    PyModule_AddIntConstant(m, "FASTUPSAMPLE", FLAG_FASTUPSAMPLE);
    PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER",
#ifdef LIBJPEG_TURBO_VERSION_NUMBER
                            LIBJPEG_TURBO_VERSION_NUMBER
#else
                            JPEG_LIB_VERSION
#endif
    );
    return m;
}
