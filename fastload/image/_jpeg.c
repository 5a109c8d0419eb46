/* A JPEG region decoder on the system's libjpeg-turbo: only the rows and columns of a crop, at a DCT scale.
 *
 * Owns: decode_region(data, top, left, height, width, scale, max_pixels, out), the one function
 * fastload/image/fast.py calls (`_turbo_region`), and nothing else.
 *
 * Why: nvImageCodec's CPU region decode (the path before this) is libjpeg-turbo behind a general codec
 * framework: per image it costs 25-60 µs more than libjpeg-turbo called directly, plus a copy of the rows it
 * decoded (docs/loader.md, "A compiled region decoder"). Here libjpeg-turbo is called directly:
 * jpeg_skip_scanlines() skips the rows above the crop without colour conversion, decoding stops after the crop's
 * last row, jpeg_crop_scanline() limits the IDCT, upsampling and colour conversion to the crop's columns (on
 * quality-90 photos that saved nothing measurable: the entropy decoding of whole rows dominates, and only restart
 * markers could skip it), and the rows are written straight into the caller's array. With a DCT scale (1/2, 1/4,
 * 1/8) the same crop is decoded from the scaled image, where fast.py decoded the whole scaled image before.
 *
 * The pixels are those of a full decode, cropped (tests/image/test_turbo.py pins that against Pillow and
 * simplejpeg): libjpeg-turbo upsamples the chroma at a crop's edge as at the image's edge, so the crop is
 * decoded one iMCU wider on each side than asked and the extra columns are dropped.
 *
 * Errors: any libjpeg error or warning (corrupt data it would recover from with grey pixels included), an image
 * over `max_pixels` (checked from the header, before libjpeg allocates for the image) and data that does not end
 * with the end-of-image marker (a file cut short below the crop would otherwise decode: decoding stops at the
 * crop) are a ValueError with the reason; fast.py then decodes the image the way it did before this module,
 * which names the problem. The GIL is released for the whole decode.
 *
 * Must not: know about crops' randomness, tensors or batches; keep state between calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

struct err_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char msg[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct err_mgr *e = (struct err_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, e->msg);
    longjmp(e->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) on_error(cinfo); /* a warning: corrupt data libjpeg would paper over */
}

/* The iMCU width at the output scale (a libjpeg-6b-ABI library names the field differently). */
#if JPEG_LIB_VERSION >= 70
#define IMCU_WIDTH(c) ((c).max_h_samp_factor * (c).min_DCT_h_scaled_size)
#else
#define IMCU_WIDTH(c) ((c).max_h_samp_factor * (c).min_DCT_scaled_size)
#endif

/* Decode into `out` (height x width x 3 bytes, C order); 0 on success, else a message in `msg`. */
static int decode(const unsigned char *data, unsigned long size, int top, int left, int height, int width,
                  int scale, long long max_pixels, unsigned char *out, char *msg, size_t msg_len) {
    struct jpeg_decompress_struct cinfo;
    struct err_mgr err;
    JSAMPLE *volatile row = NULL;
    volatile int status = 0;

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.jump)) {
        snprintf(msg, msg_len, "libjpeg: %s", err.msg);
        status = 1;
    } else {
        /* a file cut short below the crop would decode: the crop never reaches the cut. Only whole files here
           (a JPEG with bytes after its end marker goes the other way too, which decides) */
        if (size < 4 || data[size - 2] != 0xFF || data[size - 1] != 0xD9) {
            snprintf(msg, msg_len, "the data does not end with a JPEG end-of-image marker");
            status = 6;
            goto done;
        }
        jpeg_mem_src(&cinfo, data, size);
        jpeg_read_header(&cinfo, TRUE);
        if ((uint64_t)cinfo.image_width * cinfo.image_height > (uint64_t)max_pixels) {
            /* before any allocation for the image (a progressive one's coefficients are allocated whole) */
            snprintf(msg, msg_len, "%u x %u pixels is over the limit of %lld", cinfo.image_width, cinfo.image_height,
                     max_pixels);
            status = 7;
            goto done;
        }
        cinfo.out_color_space = JCS_RGB;
        cinfo.scale_num = 1;
        cinfo.scale_denom = (unsigned int)scale;
        jpeg_calc_output_dimensions(&cinfo); /* the region checked before a progressive file is read whole */
        if ((uint64_t)top + (uint64_t)height > cinfo.output_height ||
            (uint64_t)left + (uint64_t)width > cinfo.output_width) {
            snprintf(msg, msg_len, "the region (%d, %d) %d x %d is outside the %u x %u image decoded at 1/%d", top,
                     left, height, width, cinfo.output_height, cinfo.output_width, scale);
            status = 2;
        } else {
            jpeg_start_decompress(&cinfo);
            /* one iMCU more on each side than asked: the chroma next to a crop's edge is upsampled from its
               real neighbours, as in a full decode */
            int pad = IMCU_WIDTH(cinfo);
            int x0 = left > pad ? left - pad : 0;
            int x1 = left + width + pad < (int)cinfo.output_width ? left + width + pad : (int)cinfo.output_width;
            JDIMENSION xoff = (JDIMENSION)x0, cw = (JDIMENSION)(x1 - x0);
            jpeg_crop_scanline(&cinfo, &xoff, &cw);
            int direct = xoff == (JDIMENSION)left && cw == (JDIMENSION)width;
            if (!direct && (row = (JSAMPLE *)malloc((size_t)cw * 3)) == NULL) {
                snprintf(msg, msg_len, "out of memory for a row of %u pixels", cw);
                status = 3;
            } else {
                if (top > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)top) != (JDIMENSION)top) {
                    snprintf(msg, msg_len, "libjpeg skipped fewer than %d rows", top);
                    status = 4;
                }
                for (int y = 0; status == 0 && y < height; y++) {
                    unsigned char *dst = out + (size_t)y * width * 3;
                    JSAMPROW p = direct ? dst : row;
                    if (jpeg_read_scanlines(&cinfo, &p, 1) != 1) {
                        snprintf(msg, msg_len, "libjpeg stopped at row %d of the region", y);
                        status = 5;
                    } else if (!direct) {
                        memcpy(dst, row + (size_t)(left - (int)xoff) * 3, (size_t)width * 3);
                    }
                }
            }
        }
    }
done:
    free(row);
    jpeg_destroy_decompress(&cinfo); /* also ends a decode stopped before the image's last row */
    return status;
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    int top, left, height, width, scale, status;
    long long max_pixels;
    char msg[JMSG_LENGTH_MAX + 128] = "";
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iiiiiLw*", &data, &top, &left, &height, &width, &scale, &max_pixels, &out))
        return NULL;
    if (top < 0 || left < 0 || height < 1 || width < 1 || !(scale == 1 || scale == 2 || scale == 4 || scale == 8)) {
        PyErr_Format(PyExc_ValueError, "bad region (%d, %d) %d x %d or scale 1/%d (1, 2, 4 or 8)", top, left, height,
                     width, scale);
        status = -1;
    } else if (!PyBuffer_IsContiguous(&out, 'C') || out.len != (Py_ssize_t)height * width * 3) {
        PyErr_SetString(PyExc_ValueError, "out must be a contiguous buffer of height x width x 3 bytes");
        status = -1;
    } else {
        Py_BEGIN_ALLOW_THREADS
        status = decode((const unsigned char *)data.buf, (unsigned long)data.len, top, left, height, width, scale,
                        max_pixels, (unsigned char *)out.buf, msg, sizeof msg);
        Py_END_ALLOW_THREADS
        if (status) PyErr_SetString(PyExc_ValueError, msg);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (status) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, top, left, height, width, scale, max_pixels, out): the region of the JPEG `data` decoded "
     "at 1/scale (1, 2, 4 or 8), written into `out` (height x width x 3 bytes, RGB, C order). ValueError on any "
     "libjpeg error or warning, an image of more than max_pixels pixels, or data that does not end with the "
     "end-of-image marker."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg", "A JPEG region decoder on libjpeg-turbo.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
