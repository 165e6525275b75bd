//! Element kinds that both the loaders and the layers branch on: a weight stored in an 8-bit float
//! kind is kept resident or dequantised at load (`loading::weights`, `loading::lora`) and upcast at
//! every call of the layer holding it (`nn::Linear`). A module of its own so that the loaders do
//! not import the layers, which import the loaders' `Weights`.

use tch::Kind;

/// Whether `kind` is one of the 8-bit float kinds.
pub fn is_fp8(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float8e4m3fn | Kind::Float8e5m2 | Kind::Float8e4m3fnuz | Kind::Float8e5m2fnuz
    )
}
