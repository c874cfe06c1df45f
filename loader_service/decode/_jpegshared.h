/* What the native JPEG extensions (_jpegroi.c, _jpegprep.c) share.
 *
 * Strict libjpeg error handling: an error, and every warning too ("premature end of data segment", "corrupt JPEG data"), longjmps to the caller's
 * setjmp with the library's message; never grey or garbage pixels. Trace messages are ignored.
 *
 *     struct strict_err err;
 *     cinfo.err = strict_err_init(&err);
 *     jpeg_create_decompress(&cinfo);
 *     if (setjmp(err.jb)) { ... err.msg ... }
 */
#ifndef LOADER_JPEGSHARED_H
#define LOADER_JPEGSHARED_H

#include <setjmp.h>
#include <stdio.h>
#include <jpeglib.h>

struct strict_err {
    struct jpeg_error_mgr pub;
    jmp_buf jb;
    char msg[JMSG_LENGTH_MAX];
};

static void strict_error_exit(j_common_ptr c)
{
    struct strict_err *e = (struct strict_err *)c->err;
    (*c->err->format_message)(c, e->msg);
    longjmp(e->jb, 1);
}

static void strict_emit_message(j_common_ptr c, int level)
{
    if (level < 0) /* a warning: corrupt or truncated data; refuse it */
        strict_error_exit(c);
}

static struct jpeg_error_mgr *strict_err_init(struct strict_err *e)
{
    jpeg_std_error(&e->pub);
    e->pub.error_exit = strict_error_exit;
    e->pub.emit_message = strict_emit_message;
    e->msg[0] = 0;
    return &e->pub;
}

/* The MCU grid of a scan with all of the frame's components, which is what restart intervals
 * count in (the preparation tool writes them, the decode kernel reads them: one rule for both).
 * An interleaved scan's MCU spans max_h x max_v sampling blocks; a single component's is one
 * block (8x8 image pixels when its sampling is the frame's). Valid after jpeg_read_header. */
static inline unsigned int mcu_width(j_decompress_ptr c)
{
    return c->num_components == 1 ? DCTSIZE : (unsigned int)c->max_h_samp_factor * DCTSIZE;
}

static inline unsigned int mcu_height(j_decompress_ptr c)
{
    return c->num_components == 1 ? DCTSIZE : (unsigned int)c->max_v_samp_factor * DCTSIZE;
}

static inline unsigned int mcus_per_row(j_decompress_ptr c)
{
    if (c->num_components == 1)
        return c->comp_info[0].width_in_blocks;
    return (c->image_width + mcu_width(c) - 1) / mcu_width(c);
}

#endif
