//! Decompression of compressed clusters (raw deflate and zstd), with QEMU's
//! acceptance rules: the data must fill exactly one cluster.

use flate2::{Decompress, FlushDecompress, Status};
use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};

use crate::entry::CompressedDescriptor;
use crate::error::ErrorKind;
use crate::header::CompressionType;
use crate::storage::ReadPattern;
use crate::storage::Storage;
use crate::types::Geometry;

/// Reads and decompresses the compressed cluster `d` of an image.
pub(crate) fn read_compressed_cluster(
    storage: &dyn Storage,
    kind: CompressionType,
    geometry: Geometry,
    d: CompressedDescriptor,
    pattern: ReadPattern,
) -> Result<Vec<u8>, ErrorKind> {
    let file_size = storage.len()?;
    if d.offset.0 >= file_size {
        return Err(ErrorKind::CompressedBeyondEof {
            offset: d.offset.0,
            len: d.len,
            file_size,
        });
    }
    let mut packed = vec![0u8; d.len as usize];
    pattern.read(storage, &mut packed, d.offset.0)?;
    let mut cluster = vec![0u8; geometry.cluster_size() as usize];
    decompress(kind, &packed, &mut cluster).map_err(|reason| ErrorKind::Decompression {
        offset: d.offset.0,
        algorithm: match kind {
            CompressionType::Deflate => "deflate",
            CompressionType::Zstd => "zstd",
        },
        reason,
    })?;
    Ok(cluster)
}

/// Decompresses `input` into `out`, which must be filled completely.
pub(crate) fn decompress(
    kind: CompressionType,
    input: &[u8],
    out: &mut [u8],
) -> Result<(), String> {
    match kind {
        CompressionType::Deflate => inflate(input, out),
        CompressionType::Zstd => unzstd(input, out),
    }
}

/// Raw deflate (no zlib header), as QEMU writes with window bits -12.
fn inflate(input: &[u8], out: &mut [u8]) -> Result<(), String> {
    let mut z = Decompress::new(false);
    loop {
        let (in_pos, out_pos) = (z.total_in() as usize, z.total_out() as usize);
        let status = z
            .decompress(
                &input[in_pos..],
                &mut out[out_pos..],
                FlushDecompress::Finish,
            )
            .map_err(|e| e.to_string())?;
        let done = z.total_out() as usize;
        if done == out.len() {
            return Ok(());
        }
        let progressed = z.total_in() as usize != in_pos || done != out_pos;
        if status == Status::StreamEnd || !progressed {
            return Err(format!("data ends after {done} of {} bytes", out.len()));
        }
    }
}

/// zstd, possibly several frames, possibly followed by padding.
fn unzstd(input: &[u8], out: &mut [u8]) -> Result<(), String> {
    let mut decoder = Decoder::new().map_err(|e| e.to_string())?;
    let mut src = InBuffer::around(input);
    let mut dst = OutBuffer::around(out);
    let mut hint = 0;
    while dst.pos() < dst.capacity() {
        let (in_pos, out_pos) = (src.pos(), dst.pos());
        hint = decoder.run(&mut src, &mut dst).map_err(|e| e.to_string())?;
        if src.pos() == in_pos && dst.pos() == out_pos {
            return Err(format!(
                "data ends after {} of {} bytes",
                dst.pos(),
                dst.capacity()
            ));
        }
    }
    if hint != 0 {
        return Err("frame continues past the end of the cluster".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::{Compress, Compression, FlushCompress};

    fn deflate(data: &[u8]) -> Vec<u8> {
        let mut c = Compress::new(Compression::default(), false);
        let mut out = Vec::with_capacity(data.len() + 64);
        c.compress_vec(data, &mut out, FlushCompress::Finish)
            .unwrap();
        out
    }

    #[test]
    fn deflate_round_trip_with_padding() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i % 7) as u8).collect();
        let mut packed = deflate(&data);
        packed.extend_from_slice(&[0xaa; 300]);
        let mut out = vec![0; 4096];
        decompress(CompressionType::Deflate, &packed, &mut out).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn deflate_short_output_is_an_error() {
        let packed = deflate(&[1u8; 1000]);
        let mut out = vec![0; 4096];
        assert!(decompress(CompressionType::Deflate, &packed, &mut out).is_err());
    }

    #[test]
    fn zstd_round_trip_and_garbage() {
        let data: Vec<u8> = (0..65536u32).map(|i| (i / 100) as u8).collect();
        let mut packed = zstd::bulk::compress(&data, 3).unwrap();
        packed.extend_from_slice(&[0; 100]);
        let mut out = vec![0; 65536];
        decompress(CompressionType::Zstd, &packed, &mut out).unwrap();
        assert_eq!(out, data);
        assert!(decompress(CompressionType::Zstd, &[0x55; 512], &mut out).is_err());
        assert!(decompress(CompressionType::Deflate, &[0xff; 512], &mut out).is_err());
    }
}
