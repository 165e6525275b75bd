//! The index of a zip archive whose entries are stored uncompressed, as `torch.save` writes
//! them (PyTorch's zip checkpoint format, torch ≥ 1.6): entry name → byte range of its data.
//!
//! Invariant: every range in a [`ZipIndex`] lies inside the bytes it was parsed from. Compressed
//! or encrypted entries, split archives and ranges past the end are errors, never guesses.
//!
//! Format (PKWARE APPNOTE 6.3): the end-of-central-directory record (or its zip64 form) gives the
//! central directory; each central entry gives the name, method, sizes and the offset of the local
//! header, which precedes the data. Sizes and offsets of 0xFFFF_FFFF are in the zip64 extra field.

use std::collections::HashMap;

/// Where one entry's data lies in the archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZipEntry {
    pub start: usize,
    pub len: usize,
}

/// Entry name → data range, for an archive of stored entries.
#[derive(Debug, Default)]
pub struct ZipIndex {
    entries: HashMap<String, ZipEntry>,
}

const EOCD: u32 = 0x0605_4b50;
const ZIP64_LOCATOR: u32 = 0x0706_4b50;
const ZIP64_EOCD: u32 = 0x0606_4b50;
const CENTRAL: u32 = 0x0201_4b50;
const LOCAL: u32 = 0x0403_4b50;

/// Little-endian reads with bounds checks.
struct Reader<'a> {
    data: &'a [u8],
}

impl Reader<'_> {
    fn bytes(&self, at: usize, n: usize) -> Result<&[u8], String> {
        at.checked_add(n)
            .and_then(|end| self.data.get(at..end))
            .ok_or_else(|| format!("record at byte {at} runs past the end of the file"))
    }
    fn u16(&self, at: usize) -> Result<u16, String> {
        let b = self.bytes(at, 2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&self, at: usize) -> Result<u32, String> {
        let b = self.bytes(at, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&self, at: usize) -> Result<u64, String> {
        let b = self.bytes(at, 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

fn usize_of(v: u64, what: &str) -> Result<usize, String> {
    usize::try_from(v).map_err(|_| format!("{what} {v} does not fit in memory"))
}

impl ZipIndex {
    /// Whether `data` starts like a zip archive (a local file header).
    pub fn looks_like_zip(data: &[u8]) -> bool {
        data.len() >= 4 && u32::from_le_bytes([data[0], data[1], data[2], data[3]]) == LOCAL
    }

    /// Parses the central directory of `data`.
    pub fn parse(data: &[u8]) -> Result<Self, String> {
        let r = Reader { data };
        // The EOCD record is 22 bytes plus a comment of at most 65535 bytes, at the very end.
        let lowest = data.len().saturating_sub(22 + 65535);
        let eocd = (lowest..=data.len().saturating_sub(22))
            .rev()
            .find(|&at| r.u32(at).is_ok_and(|sig| sig == EOCD))
            .ok_or("no end-of-central-directory record (not a zip archive, or truncated)")?;
        let mut count = u64::from(r.u16(eocd + 10)?);
        let mut cd_size = u64::from(r.u32(eocd + 12)?);
        let mut cd_offset = u64::from(r.u32(eocd + 16)?);
        if r.u16(eocd + 4)? != 0 || r.u16(eocd + 6)? != 0 {
            return Err("split (multi-disk) archives are not supported".into());
        }
        if count == 0xFFFF || cd_size == 0xFFFF_FFFF || cd_offset == 0xFFFF_FFFF {
            let locator = eocd
                .checked_sub(20)
                .filter(|&at| r.u32(at).is_ok_and(|sig| sig == ZIP64_LOCATOR))
                .ok_or("zip64 sizes without a zip64 locator")?;
            let at = usize_of(r.u64(locator + 8)?, "zip64 record offset")?;
            if r.u32(at)? != ZIP64_EOCD {
                return Err("zip64 locator does not point at a zip64 record".into());
            }
            count = r.u64(at + 32)?;
            cd_size = r.u64(at + 40)?;
            cd_offset = r.u64(at + 48)?;
        }
        let cd_offset = usize_of(cd_offset, "central directory offset")?;
        let cd_end = cd_offset
            .checked_add(usize_of(cd_size, "central directory size")?)
            .filter(|&end| end <= data.len())
            .ok_or("central directory lies past the end of the file (truncated?)")?;
        let mut entries = HashMap::new();
        let mut at = cd_offset;
        for _ in 0..count {
            if at + 46 > cd_end || r.u32(at)? != CENTRAL {
                return Err(format!("central directory entry at byte {at} is malformed"));
            }
            let flags = r.u16(at + 8)?;
            let method = r.u16(at + 10)?;
            let mut comp = u64::from(r.u32(at + 20)?);
            let mut size = u64::from(r.u32(at + 24)?);
            let name_len = usize::from(r.u16(at + 28)?);
            let extra_len = usize::from(r.u16(at + 30)?);
            let comment_len = usize::from(r.u16(at + 32)?);
            let mut local = u64::from(r.u32(at + 42)?);
            let name = String::from_utf8(r.bytes(at + 46, name_len)?.to_vec())
                .map_err(|_| format!("entry name at byte {at} is not UTF-8"))?;
            // zip64 extra field: the 8-byte values present are those whose 4-byte field is full.
            let mut extra = at + 46 + name_len;
            let extra_end = extra + extra_len;
            while extra + 4 <= extra_end {
                let id = r.u16(extra)?;
                let len = usize::from(r.u16(extra + 2)?);
                if id == 0x0001 {
                    let mut p = extra + 4;
                    for field in [&mut size, &mut comp, &mut local] {
                        if *field == 0xFFFF_FFFF {
                            *field = r.u64(p)?;
                            p += 8;
                        }
                    }
                }
                extra += 4 + len;
            }
            if flags & 1 != 0 {
                return Err(format!("entry `{name}` is encrypted"));
            }
            if method != 0 {
                return Err(format!(
                    "entry `{name}` is compressed (method {method}); PyTorch checkpoints store \
                     their entries uncompressed"
                ));
            }
            if comp != size {
                return Err(format!("entry `{name}` is stored but its sizes differ"));
            }
            let local = usize_of(local, "local header offset")?;
            if r.u32(local)? != LOCAL {
                return Err(format!("entry `{name}`: no local header at byte {local}"));
            }
            let start =
                local + 30 + usize::from(r.u16(local + 26)?) + usize::from(r.u16(local + 28)?);
            let len = usize_of(size, "entry size")?;
            if start.checked_add(len).is_none_or(|end| end > data.len()) {
                return Err(format!(
                    "entry `{name}` needs bytes {start}..{} but the file holds {} (truncated?)",
                    start.saturating_add(len),
                    data.len()
                ));
            }
            entries.insert(name, ZipEntry { start, len });
            at += 46 + name_len + extra_len + comment_len;
        }
        Ok(Self { entries })
    }

    pub fn get(&self, name: &str) -> Option<ZipEntry> {
        self.entries.get(name).copied()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }
}
