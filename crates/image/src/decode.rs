//! Decoding image bytes into 8-bit RGB, the way the reference sees a `PIL.Image.open` image.
//!
//! The reference (`TorchvisionBackend.process_image` on a PIL image) runs transformers'
//! `convert_to_rgb`: an image with an alpha band or a `transparency` entry (palette or
//! colour-key `tRNS`, GIF transparent index) is converted to RGBA and alpha-composited onto
//! opaque white with `PIL.Image.alpha_composite`; anything else is `convert("RGB")`.
//! The `image` crate expands palettes and `tRNS` into an alpha channel, so compositing every
//! alpha-carrying image onto white gives the same pixels (an opaque pixel composites to itself).
//! Pillow reads 16-bit PNG colour/alpha samples by their high byte and clips 16-bit grayscale
//! (`I;16`) to 255 when converting to RGB; both are reproduced here. EXIF orientation is not
//! applied (the processor does not apply it to a PIL image either).

use std::io::Cursor;

use image::{DynamicImage, ImageFormat, ImageReader};

use crate::{ImageError, Limits};

/// A decoded image: `data` is `[height, width, 3]` row-major RGB bytes.
#[derive(Debug, Clone)]
pub(crate) struct Rgb8 {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

fn format_name(f: ImageFormat) -> &'static str {
    f.extensions_str().first().copied().unwrap_or("unknown")
}

fn map_decode_error(e: image::ImageError, what: &str) -> ImageError {
    match e {
        image::ImageError::Limits(l) => ImageError::Corrupt(format!(
            "the {what} image needs more memory to decode than allowed ({l})."
        )),
        image::ImageError::Unsupported(u) => ImageError::Unsupported(format!(
            "this {what} image uses a feature that is not supported: {u}."
        )),
        other => ImageError::Corrupt(format!("the {what} image could not be decoded: {other}.")),
    }
}

/// Decode `bytes` (PNG, JPEG, WebP or GIF; the first frame of an animation) into RGB8,
/// refusing over-limit inputs before decoding the pixels.
pub(crate) fn decode_rgb8(bytes: &[u8], limits: &Limits) -> Result<Rgb8, ImageError> {
    if bytes.is_empty() {
        return Err(ImageError::Corrupt("the image is empty (0 bytes).".into()));
    }
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooLarge {
            bytes: bytes.len(),
            max: limits.max_bytes,
        });
    }
    type Reader<'a> = ImageReader<Cursor<&'a [u8]>>;
    let reader = |bytes| -> Result<(Reader<'_>, ImageFormat), ImageError> {
        let r = ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| ImageError::Corrupt(format!("the image could not be read: {e}.")))?;
        let format = match r.format() {
            Some(
                f @ (ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif),
            ) => f,
            Some(f) => {
                return Err(ImageError::Unsupported(format!(
                    "{} images are not supported; send PNG, JPEG, WebP or GIF.",
                    format_name(f).to_uppercase()
                )))
            }
            None => {
                return Err(ImageError::Unsupported(
                    "the data is not a recognised image; send PNG, JPEG, WebP or GIF.".into(),
                ))
            }
        };
        Ok((r, format))
    };

    let (r, format) = reader(bytes)?;
    let what = format_name(format).to_uppercase();
    let mut lim = image::Limits::default();
    lim.max_image_width = None;
    lim.max_image_height = None;
    // The largest decoded buffer is 8 bytes a pixel (RGBA16), plus decoder scratch space.
    lim.max_alloc = Some(limits.max_pixels.saturating_mul(8).saturating_add(64 << 20));
    let mut r = r;
    r.limits(lim.clone());
    let (width, height) = r
        .into_dimensions()
        .map_err(|e| map_decode_error(e, &what))?;
    if width == 0 || height == 0 {
        return Err(ImageError::Corrupt(format!(
            "the {what} image has no pixels ({width}x{height})."
        )));
    }
    if u64::from(width) * u64::from(height) > limits.max_pixels {
        return Err(ImageError::TooManyPixels {
            width,
            height,
            max: limits.max_pixels,
        });
    }

    let (mut r, _) = reader(bytes)?;
    r.limits(lim);
    let img = r.decode().map_err(|e| map_decode_error(e, &what))?;
    if format == ImageFormat::Jpeg {
        // The `image` crate's decode above refuses corrupt files with an error; libjpeg-turbo
        // (which reports errors by unwinding, noisy in a server's log) then gives Pillow's
        // exact pixels.
        return decode_jpeg(bytes, width, height);
    }
    if img.width() != width || img.height() != height {
        return Err(ImageError::Corrupt(format!(
            "the {what} image declares {width}x{height} pixels but decodes to {}x{}.",
            img.width(),
            img.height()
        )));
    }
    to_rgb8(img)
}

/// Decode a JPEG (already checked to declare `width` x `height` pixels within the limits) with
/// libjpeg-turbo's decoder (the `mozjpeg` crate builds its C sources), as Pillow does:
/// the accurate integer IDCT and fancy upsampling, libjpeg's own colour conversion to RGB
/// (grayscale replicated). The decoder reports errors by unwinding; they become
/// [`ImageError::Corrupt`].
fn decode_jpeg(bytes: &[u8], width: u32, height: u32) -> Result<Rgb8, ImageError> {
    let run = || -> std::io::Result<(usize, usize, Vec<u8>)> {
        let mut d = mozjpeg::Decompress::new_mem(bytes)?;
        d.dct_method(mozjpeg::DctMethod::IntegerSlow);
        d.do_fancy_upsampling(true);
        let mut img = d.rgb()?;
        let (w, h) = (img.width(), img.height());
        let data = img.read_scanlines::<u8>()?;
        img.finish()?;
        Ok((w, h, data))
    };
    let corrupt =
        |m: String| ImageError::Corrupt(format!("the JPG image could not be decoded: {m}."));
    let (w, h, data) = match std::panic::catch_unwind(run) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => return Err(corrupt(e.to_string())),
        Err(p) => {
            let m = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the decoder failed".into());
            return Err(corrupt(m));
        }
    };
    if (w, h) != (width as usize, height as usize) || data.len() != w * h * 3 {
        return Err(ImageError::Corrupt(format!(
            "the JPG image declares {width}x{height} pixels but decodes to {w}x{h}."
        )));
    }
    Ok(Rgb8 {
        width: w,
        height: h,
        data,
    })
}

/// Composite one channel value `v` with alpha `a` onto opaque white, exactly as
/// `PIL.Image.alpha_composite(white, image)` does (8-bit fixed point with 7 extra bits).
#[inline]
fn over_white(v: u8, a: u8) -> u8 {
    if a == 0 {
        return 255;
    }
    let (v, a) = (u32::from(v), u32::from(a));
    let out_a255 = a * 255 + 255 * (255 - a);
    let coef1 = a * 255 * 255 * 128 / out_a255;
    let coef2 = 255 * 128 - coef1;
    let t = v * coef1 + 255 * coef2 + (0x80 << 7);
    // Divide by 255 with rounding as Pillow does: ((t >> 8) + t) >> 8, then drop the 7 bits.
    (((((t >> 8) + t) >> 8) >> 7).min(255)) as u8
}

fn to_rgb8(img: DynamicImage) -> Result<Rgb8, ImageError> {
    let width = img.width() as usize;
    let height = img.height() as usize;
    let n = width * height;
    let mut data = Vec::with_capacity(n * 3);
    match img {
        DynamicImage::ImageRgb8(b) => data = b.into_raw(),
        DynamicImage::ImageRgba8(b) => {
            for p in b.as_raw().chunks_exact(4) {
                data.extend_from_slice(&[
                    over_white(p[0], p[3]),
                    over_white(p[1], p[3]),
                    over_white(p[2], p[3]),
                ]);
            }
        }
        DynamicImage::ImageLuma8(b) => {
            for &v in b.as_raw() {
                data.extend_from_slice(&[v, v, v]);
            }
        }
        DynamicImage::ImageLumaA8(b) => {
            for p in b.as_raw().chunks_exact(2) {
                let v = over_white(p[0], p[1]);
                data.extend_from_slice(&[v, v, v]);
            }
        }
        DynamicImage::ImageRgb16(b) => {
            data.extend(b.as_raw().iter().map(|&v| (v >> 8) as u8));
        }
        DynamicImage::ImageRgba16(b) => {
            for p in b.as_raw().chunks_exact(4) {
                let a = (p[3] >> 8) as u8;
                for &v in &p[..3] {
                    data.push(over_white((v >> 8) as u8, a));
                }
            }
        }
        DynamicImage::ImageLuma16(b) => {
            // Pillow opens 16-bit grayscale PNG as "I;16" and clips it to 255 in convert("RGB").
            for &v in b.as_raw() {
                let v = v.min(255) as u8;
                data.extend_from_slice(&[v, v, v]);
            }
        }
        DynamicImage::ImageLumaA16(b) => {
            for p in b.as_raw().chunks_exact(2) {
                let v = over_white((p[0] >> 8) as u8, (p[1] >> 8) as u8);
                data.extend_from_slice(&[v, v, v]);
            }
        }
        other => {
            return Err(ImageError::Unsupported(format!(
                "images with {:?} pixels are not supported.",
                other.color()
            )))
        }
    }
    if data.len() != n * 3 {
        return Err(ImageError::Corrupt(
            "the image decoded to an unexpected number of samples.".into(),
        ));
    }
    Ok(Rgb8 {
        width,
        height,
        data,
    })
}

#[cfg(test)]
mod tests {
    use super::over_white;

    #[test]
    fn composite_endpoints() {
        for v in 0..=255u8 {
            assert_eq!(over_white(v, 255), v);
            assert_eq!(over_white(v, 0), 255);
        }
        assert_eq!(over_white(0, 128), 127);
    }
}
