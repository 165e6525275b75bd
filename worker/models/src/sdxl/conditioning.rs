//! Prompt conditioning for SDXL: A1111-syntax prompts turned into `[1, 77·k, 768+1280]` context
//! embeddings and a pooled bigG embedding, with compel's weighting maths.
//!
//! Follows compel 2.5.1 `embeddings_provider.py` (MIT) as summarised in models.md §6:
//! - fragments are tokenised separately (no BOS/EOS) and concatenated with per-token weights;
//! - split into windows of 75 content tokens at the last sentence end (`.`), else phrase end
//!   (`, . ; :`), else word end, else brutally (`SplitLongTextMode.SENTENCES`, compel's default);
//!   each window framed `[BOS] … [EOS] pad…` to 77 and encoded separately (penultimate hidden
//!   state, not normalised);
//! - weights: `z_w = empty_z + (z − empty_z)·w` per token, exact `z` where `w == 1`;
//! - each fragment with `w < 1` adds an encoding with that fragment's tokens masked out of
//!   attention (window BOS/EOS kept), blended with weight `tan((1 − w)·π/2)`, all blend weights
//!   normalised to sum 1 (`DownweightMode.MASK`);
//! - windows are independent: `Compel.__init__` defaults to `SplitLongTextMode.SENTENCES` without
//!   the CLS-copy flag (models.md §6; checked against compel 2.5.1 in the fixtures);
//! - `BREAK` sections are encoded separately and concatenated on the token axis (compel's
//!   `.and()` conjunction);
//! - a shorter conditioning (e.g. the negative prompt) is padded with empty-prompt windows.
//!
//! Pooled embedding (our rule, documented in the README): bigG's `text_embeds` of the first 75
//! tokens of the prompt with the weighting syntax removed, unweighted and unmasked. For plain
//! prompts this equals compel's and diffusers' pooled embedding; compel itself pools the raw
//! string including its syntax characters.

use tch::Tensor;

use crate::sdxl::clip::ClipTextModel;
use crate::text::clip_tokenizer::{CHUNK, ClipTokenizer, MAX_LENGTH};
use crate::text::prompt::{Fragment, parse};

/// One encoder with its tokenizer.
#[derive(Debug)]
pub struct EncoderPair<'a> {
    pub model: &'a ClipTextModel,
    pub tokenizer: &'a ClipTokenizer,
}

/// The conditioning of one prompt.
#[derive(Debug)]
pub struct Conditioning {
    /// `[1, 77·k, D1 + D2]`.
    pub embeds: Tensor,
    /// `[1, P]` from encoder 2.
    pub pooled: Tensor,
}

/// Token ids, weights and fragment ranges of one section, windowed and framed.
struct Windows {
    ids: Vec<i64>,
    weights: Vec<f64>,
    /// Inclusive ranges in `ids` of fragments with weight < 1, with their weight.
    downweighted: Vec<(usize, usize, f64)>,
}

/// compel's `_find_next_best_split_point` with `SplitLongTextMode.SENTENCES`.
fn split_point(tok: &ClipTokenizer, ids: &[i64]) -> usize {
    if ids.len() <= CHUNK {
        return CHUNK;
    }
    let strs: Vec<String> = ids[..CHUNK]
        .iter()
        .map(|&i| tok.token(i).unwrap_or_default())
        .collect();
    let find = |pred: &dyn Fn(&str) -> bool| strs.iter().rposition(|s| pred(s));
    let sentence = |s: &str| s == ".</w>";
    let phrase = |s: &str| matches!(s, ".</w>" | ",</w>" | ";</w>" | ":</w>");
    let word = |s: &str| s.ends_with("</w>");
    find(&sentence)
        .or_else(|| find(&phrase))
        .or_else(|| find(&word))
        .map_or(CHUNK, |i| i + 1)
}

fn windows(tok: &ClipTokenizer, fragments: &[Fragment]) -> Result<Windows, String> {
    let mut flat = Vec::new();
    let mut flat_w = Vec::new();
    let mut ranges = Vec::new();
    for f in fragments {
        let ids = tok.encode(&f.text)?;
        if !ids.is_empty() {
            ranges.push((flat.len(), flat.len() + ids.len() - 1, f.weight));
        }
        flat_w.extend(std::iter::repeat_n(f.weight, ids.len()));
        flat.extend(ids);
    }
    // Position of each flat token in the framed layout.
    let mut pos = Vec::with_capacity(flat.len());
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    let mut rest = 0;
    loop {
        let n = split_point(tok, &flat[rest..]).min(flat.len() - rest);
        ids.push(tok.bos);
        weights.push(1.0);
        for k in rest..rest + n {
            pos.push(ids.len());
            ids.push(flat[k]);
            weights.push(flat_w[k]);
        }
        ids.push(tok.eos);
        weights.push(1.0);
        while ids.len() % MAX_LENGTH != 0 {
            ids.push(tok.pad);
            weights.push(1.0);
        }
        rest += n;
        if rest >= flat.len() {
            break;
        }
    }
    let downweighted = ranges
        .into_iter()
        .filter(|&(_, _, w)| w < 1.0)
        .map(|(a, b, w)| (pos[a], pos[b], w))
        .collect();
    Ok(Windows {
        ids,
        weights,
        downweighted,
    })
}

impl EncoderPair<'_> {
    fn device(&self) -> tch::Device {
        self.model.device()
    }

    /// Penultimate hidden state of one 77-token window.
    fn encode_window(&self, ids: &[i64], mask: Option<&[i64]>) -> Tensor {
        let d = self.device();
        let t = Tensor::from_slice(ids).view([1, -1]).to_device(d);
        let m = mask.map(|m| Tensor::from_slice(m).view([1, -1]).to_device(d));
        self.model.forward(&t, m.as_ref()).penultimate
    }

    fn empty_z(&self) -> Tensor {
        let mut ids = vec![self.tokenizer.bos, self.tokenizer.eos];
        ids.resize(MAX_LENGTH, self.tokenizer.pad);
        self.encode_window(&ids, None)
    }

    /// compel's `build_weighted_embedding_tensor`.
    fn weighted(&self, w: &Windows, mask: Option<&[i64]>, empty: &Tensor) -> Tensor {
        let mut parts = Vec::new();
        for (c, ids) in w.ids.chunks(MAX_LENGTH).enumerate() {
            let range = c * MAX_LENGTH..(c + 1) * MAX_LENGTH;
            let z = self.encode_window(ids, mask.map(|m| &m[range.clone()]));
            let weights = &w.weights[range];
            if weights.iter().all(|&x| x == 1.0) {
                parts.push(z);
                continue;
            }
            let wt = Tensor::from_slice(weights)
                .to_kind(z.kind())
                .to_device(z.device())
                .view([1, -1, 1]);
            let identity = wt.eq(1.0);
            let weighted = empty + (&z - empty) * &wt;
            parts.push(z.where_self(&identity, &weighted));
        }
        Tensor::cat(&parts, 1)
    }

    /// One section's embedding `[1, 77·k, D]`.
    fn section(&self, fragments: &[Fragment], empty: &Tensor) -> Result<Tensor, String> {
        let w = windows(self.tokenizer, fragments)?;
        let ones = vec![1i64; w.ids.len()];
        let base = self.weighted(&w, Some(&ones), empty);
        let mut embeddings = vec![base];
        let mut blend = vec![1.0f64];
        for &(a, b, weight) in &w.downweighted {
            let mut mask = ones.clone();
            for m in &mut mask[a..=b] {
                *m = 0;
            }
            for (i, m) in mask.iter_mut().enumerate() {
                if i % MAX_LENGTH == 0 || i % MAX_LENGTH == MAX_LENGTH - 1 {
                    *m = 1;
                }
            }
            embeddings.push(self.weighted(&w, Some(&mask), empty));
            blend.push(((1.0 - weight.max(1e-5)) * std::f64::consts::PI / 2.0).tan());
        }
        let kind = embeddings[0].kind();
        let bw = Tensor::from_slice(&blend)
            .to_kind(kind)
            .to_device(embeddings[0].device());
        let bw = &bw / bw.sum(kind);
        let stacked = Tensor::stack(&embeddings, 1); // [1, K, L, D]
        let z = (stacked * bw.view([1, -1, 1, 1])).sum_dim_intlist(1, false, kind);
        Ok(z)
    }

    /// All sections of a prompt concatenated on the token axis.
    fn prompt(&self, sections: &[Vec<Fragment>], empty: &Tensor) -> Result<Tensor, String> {
        let parts = sections
            .iter()
            .map(|s| self.section(s, empty))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Tensor::cat(&parts, 1))
    }
}

/// Encodes prompts with both SDXL text encoders.
#[derive(Debug)]
pub struct PromptEncoder<'a> {
    pub clip_l: EncoderPair<'a>,
    pub clip_g: EncoderPair<'a>,
}

impl PromptEncoder<'_> {
    /// `[1, 77, D1 + D2]` of the empty prompt (padding windows).
    pub fn empty(&self) -> Tensor {
        Tensor::cat(&[self.clip_l.empty_z(), self.clip_g.empty_z()], -1)
    }

    /// The conditioning of an A1111-syntax prompt.
    pub fn encode(&self, prompt: &str) -> Result<Conditioning, String> {
        let parsed = parse(prompt);
        let (el, eg) = (self.clip_l.empty_z(), self.clip_g.empty_z());
        let mut l = self.clip_l.prompt(&parsed.sections, &el)?;
        let mut g = self.clip_g.prompt(&parsed.sections, &eg)?;
        // Tokenizers with different special tokens could chunk differently: pad the shorter.
        while l.size()[1] < g.size()[1] {
            l = Tensor::cat(&[l, el.shallow_clone()], 1);
        }
        while g.size()[1] < l.size()[1] {
            g = Tensor::cat(&[g, eg.shallow_clone()], 1);
        }
        let embeds = Tensor::cat(&[l, g], -1);
        // Pooled: first 75 tokens of all fragments, unweighted.
        let tok = self.clip_g.tokenizer;
        let mut ids = vec![tok.bos];
        for f in parsed.sections.iter().flatten() {
            ids.extend(tok.encode(&f.text)?);
        }
        ids.truncate(CHUNK + 1);
        ids.push(tok.eos);
        ids.resize(MAX_LENGTH, tok.pad);
        let t = Tensor::from_slice(&ids)
            .view([1, -1])
            .to_device(self.clip_g.device());
        let out = self.clip_g.model.forward(&t, None);
        let pooled = out.text_embeds.unwrap_or(out.pooled);
        Ok(Conditioning { embeds, pooled })
    }

    /// Pads `a` and `b` to the same token length with empty-prompt windows.
    pub fn pad_to_same_length(&self, a: Tensor, b: Tensor) -> (Tensor, Tensor) {
        let empty = self.empty().to_kind(a.kind());
        let pad = |mut t: Tensor, n: i64| {
            while t.size()[1] < n {
                t = Tensor::cat(&[t, empty.shallow_clone()], 1);
            }
            t
        };
        let n = a.size()[1].max(b.size()[1]);
        (pad(a, n), pad(b, n))
    }
}
