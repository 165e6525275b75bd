//! [`RrdbConfig`]: the sizes of an RRDBNet, as presets of the released Real-ESRGAN models or read
//! off a checkpoint's tensor shapes.

/// BasicSR `RRDBNet(num_in_ch, num_out_ch, scale, num_feat, num_block, num_grow_ch)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RrdbConfig {
    /// Image channels in and out (3 for every released model).
    pub num_in_ch: i64,
    pub num_out_ch: i64,
    /// Upscaling factor of the network: 4, or 2 / 1 through a pixel-unshuffle of the input by 2 / 4.
    pub scale: i64,
    pub num_feat: i64,
    /// RRDB blocks in the trunk (`body.0` … `body.{num_block-1}`).
    pub num_block: i64,
    pub num_grow_ch: i64,
}

impl RrdbConfig {
    /// `RealESRGAN_x4plus.pth`: `RRDBNet(3, 3, 64, 23, 32, scale=4)` (Real-ESRGAN
    /// `inference_realesrgan.py`, model `RealESRGAN_x4plus`).
    pub fn x4plus() -> Self {
        Self {
            num_in_ch: 3,
            num_out_ch: 3,
            scale: 4,
            num_feat: 64,
            num_block: 23,
            num_grow_ch: 32,
        }
    }

    /// `RealESRGAN_x4plus_anime_6B.pth`: `RRDBNet(3, 3, 64, 6, 32, scale=4)`, the anime model
    /// visual-novel art uses.
    pub fn x4plus_anime_6b() -> Self {
        Self {
            num_block: 6,
            ..Self::x4plus()
        }
    }

    /// `RealESRGAN_x2plus.pth`: `RRDBNet(3, 3, 64, 23, 32, scale=2)`.
    pub fn x2plus() -> Self {
        Self {
            scale: 2,
            ..Self::x4plus()
        }
    }

    /// Pixel-unshuffle factor applied to the input before `conv_first` (1 for ×4).
    pub fn unshuffle(&self) -> i64 {
        match self.scale {
            2 => 2,
            1 => 4,
            _ => 1,
        }
    }

    /// Reads the sizes off a checkpoint in BasicSR naming, given each tensor's shape:
    /// `conv_first.weight` `[num_feat, num_in_ch·u², 3, 3]`, `conv_last.weight`
    /// `[num_out_ch, num_feat, 3, 3]`, `body.0.rdb1.conv1.weight` `[num_grow_ch, num_feat, 3, 3]`,
    /// the blocks counted from `body.N.rdb1.conv1.weight`. The unshuffle factor `u` (so the scale)
    /// follows from `conv_first`'s input channels assuming as many image channels in as out.
    pub fn detect<'a>(
        names: impl IntoIterator<Item = &'a str>,
        shape: impl Fn(&str) -> Option<Vec<i64>>,
    ) -> Result<Self, String> {
        let conv = |name: &str| -> Result<[i64; 4], String> {
            let s = shape(name)
                .ok_or_else(|| format!("no `{name}`: not an RRDBNet (Real-ESRGAN) checkpoint"))?;
            <[i64; 4]>::try_from(s.as_slice())
                .map_err(|_| format!("`{name}` has shape {s:?}, expected a 4-D conv weight"))
        };
        let [num_feat, in_total, _, _] = conv("conv_first.weight")?;
        let [num_out_ch, _, _, _] = conv("conv_last.weight")?;
        let [num_grow_ch, _, _, _] = conv("body.0.rdb1.conv1.weight")?;
        let mut blocks: Vec<i64> = names
            .into_iter()
            .filter_map(|n| {
                n.strip_prefix("body.")?
                    .strip_suffix(".rdb1.conv1.weight")?
                    .parse()
                    .ok()
            })
            .collect();
        blocks.sort_unstable();
        let num_block = blocks.len() as i64;
        if blocks.iter().copied().ne(0..num_block) {
            return Err(format!(
                "RRDB blocks are not numbered 0..{num_block}: {blocks:?}"
            ));
        }
        let scale = match in_total.checked_div(num_out_ch) {
            Some(1) if in_total == num_out_ch => 4,
            Some(4) if in_total == 4 * num_out_ch => 2,
            Some(16) if in_total == 16 * num_out_ch => 1,
            _ => {
                return Err(format!(
                    "`conv_first.weight` takes {in_total} channels for {num_out_ch} output \
                     channels: not ×1, ×2 or ×4"
                ));
            }
        };
        Ok(Self {
            num_in_ch: num_out_ch,
            num_out_ch,
            scale,
            num_feat,
            num_block,
            num_grow_ch,
        })
    }
}
