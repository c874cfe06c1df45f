/* Strict libjpeg error handling shared by the native JPEG extensions: an error, and every
 * warning too ("premature end of data segment", "corrupt JPEG data"), longjmps to the caller's
 * setjmp with the library's message; never grey or garbage pixels. Trace messages are ignored.
 *
 *     struct strict_err err;
 *     cinfo.err = strict_err_init(&err);
 *     jpeg_create_decompress(&cinfo);
 *     if (setjmp(err.jb)) { ... err.msg ... }
 */
#ifndef LOADER_JPEGSTRICT_H
#define LOADER_JPEGSTRICT_H

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

#endif
