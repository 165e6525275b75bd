//! The values optional fields of the wire types take when a message leaves them out. The types that
//! use them also have required fields (a prompt, a job id), so they cannot take a struct-level
//! `#[serde(default)]` with one `Default` impl: each optional field names its function here, and the
//! OpenAPI document shows the value.

pub(crate) fn side() -> u32 {
    1024
}
pub(crate) fn generate_steps() -> u32 {
    20
}
pub(crate) fn generate_cfg() -> f32 {
    4.5
}
pub(crate) fn edit_steps() -> u32 {
    4
}
pub(crate) fn edit_cfg() -> f32 {
    1.0
}
pub(crate) fn scale() -> u32 {
    2
}
/// A count, a weight or a protocol version of one.
pub(crate) fn one() -> u32 {
    1
}
pub(crate) fn one_f32() -> f32 {
    1.0
}
pub(crate) fn is_one(v: &u32) -> bool {
    *v == 1
}
