//! A restricted reader of the pickles inside PyTorch checkpoints: it builds plain values
//! (None, bools, ints, floats, strings, bytes, tuples, lists, dicts) and tensor *references*,
//! and refuses everything else.
//!
//! Invariant: nothing in the file is ever executed. A pickle is a program for Python's pickle
//! machine, and `GLOBAL` + `REDUCE` can call any importable function (`os.system`). This reader
//! knows only the globals `torch.save` emits for a state dict, and interprets each itself:
//! `collections.OrderedDict` (an empty dict), `torch._utils._rebuild_tensor_v2` /
//! `_rebuild_tensor` / `_rebuild_parameter` / `_rebuild_parameter_with_state` (a tensor view on a
//! storage) and the typed storage classes `torch.FloatStorage` … (a dtype). Any other global,
//! object construction (`NEWOBJ`, `OBJ`, `INST`), `BUILD` on anything but a dict, or an unknown
//! opcode is an error that names it. Persistent ids must be PyTorch's storage tuples
//! `("storage", <storage class>, key, location, numel)`; their bytes are not read here.
//!
//! Opcodes follow CPython's `Lib/pickletools.py` (protocols 0–5, binary forms only; `torch.save`
//! writes protocol 2). Values live in an arena, so a memoised dict that is filled later is the
//! same dict wherever it is referenced.

use std::collections::HashMap;

use tch::Kind;

/// A PyTorch storage: `data/<key>` in the archive, `numel` elements of `kind`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageRef {
    pub key: String,
    pub kind: Kind,
    pub numel: i64,
}

/// A tensor as `torch._utils._rebuild_tensor_v2` would build it: a strided view of a storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRef {
    pub storage: StorageRef,
    /// In elements.
    pub offset: i64,
    pub shape: Vec<i64>,
    pub stride: Vec<i64>,
}

/// A pickled value (containers refer to other values by [`Id`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Id>),
    List(Vec<Id>),
    /// Insertion order kept (state dicts are `OrderedDict`s).
    Dict(Vec<(Id, Id)>),
    Tensor(TensorRef),
    /// One of the allowed globals, before it is called.
    Global(Global),
    Storage(StorageRef),
}

/// Index of a value in the [`Unpickled`] arena.
pub type Id = usize;

/// The globals a state-dict pickle may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Global {
    OrderedDict,
    RebuildTensorV2,
    RebuildTensor,
    RebuildParameter,
    RebuildParameterWithState,
    Storage(Kind),
}

impl Global {
    fn lookup(module: &str, name: &str) -> Option<Self> {
        Some(match (module, name) {
            ("collections", "OrderedDict") => Global::OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
            ("torch._utils", "_rebuild_tensor") => Global::RebuildTensor,
            ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
            ("torch._utils", "_rebuild_parameter_with_state") => Global::RebuildParameterWithState,
            ("torch", storage) => Global::Storage(match storage {
                "FloatStorage" => Kind::Float,
                "DoubleStorage" => Kind::Double,
                "HalfStorage" => Kind::Half,
                "BFloat16Storage" => Kind::BFloat16,
                "LongStorage" => Kind::Int64,
                "IntStorage" => Kind::Int,
                "ShortStorage" => Kind::Int16,
                "CharStorage" => Kind::Int8,
                "ByteStorage" => Kind::Uint8,
                "BoolStorage" => Kind::Bool,
                _ => return None,
            }),
            _ => return None,
        })
    }
}

/// The result of reading one pickle: the arena and the top-level value.
#[derive(Debug)]
pub struct Unpickled {
    values: Vec<Value>,
    pub root: Id,
}

impl Unpickled {
    pub fn get(&self, id: Id) -> &Value {
        &self.values[id]
    }

    /// The string at `id`, if it is one.
    pub fn str(&self, id: Id) -> Option<&str> {
        match self.get(id) {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A short description of the value's type, for error messages.
    pub fn type_name(&self, id: Id) -> &'static str {
        match self.get(id) {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::Tuple(_) => "tuple",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
            Value::Tensor(_) => "tensor",
            Value::Global(_) => "class",
            Value::Storage(_) => "storage",
        }
    }
}

/// Upper bound on values one pickle may create (a state dict of a few thousand tensors makes a
/// few tens of thousands); guards against a pickle built to exhaust memory.
const MAX_VALUES: usize = 10_000_000;

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    values: Vec<Value>,
    stack: Vec<Id>,
    marks: Vec<usize>,
    memo: HashMap<u64, Id>,
}

/// Reads the pickle in `data` (see the module docs for what is accepted).
pub fn unpickle(data: &[u8]) -> Result<Unpickled, String> {
    let mut m = Machine {
        data,
        pos: 0,
        values: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
    };
    let root = m.run()?;
    Ok(Unpickled {
        values: m.values,
        root,
    })
}

impl<'a> Machine<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let data: &'a [u8] = self.data;
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= data.len())
            .ok_or_else(|| format!("pickle ends inside an argument at byte {}", self.pos))?;
        let out = &data[self.pos..end];
        self.pos = end;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn len_of(&mut self, n: u64) -> Result<usize, String> {
        usize::try_from(n).map_err(|_| format!("length {n} too large"))
    }
    fn line(&mut self) -> Result<&'a str, String> {
        let data: &'a [u8] = self.data;
        let rest = &data[self.pos..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("pickle ends inside a GLOBAL name")?;
        self.pos += end + 1;
        std::str::from_utf8(&rest[..end]).map_err(|_| "GLOBAL name is not UTF-8".to_string())
    }

    fn push(&mut self, v: Value) -> Result<(), String> {
        if self.values.len() >= MAX_VALUES {
            return Err(format!("pickle creates more than {MAX_VALUES} values"));
        }
        self.values.push(v);
        self.stack.push(self.values.len() - 1);
        Ok(())
    }
    fn pop(&mut self) -> Result<Id, String> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return Err("pickle pops past a MARK".into());
        }
        self.stack
            .pop()
            .ok_or_else(|| "pickle stack underflow".into())
    }
    fn pop_mark(&mut self) -> Result<Vec<Id>, String> {
        let mark = self.marks.pop().ok_or("pickle has no MARK to pop to")?;
        if mark > self.stack.len() {
            return Err("pickle MARK lies above the stack".into());
        }
        Ok(self.stack.split_off(mark))
    }
    fn top(&self) -> Result<Id, String> {
        self.stack
            .last()
            .copied()
            .ok_or_else(|| "pickle stack is empty".into())
    }
    fn int(&self, id: Id, what: &str) -> Result<i64, String> {
        match &self.values[id] {
            Value::Int(i) => Ok(*i),
            Value::Bool(b) => Ok(i64::from(*b)),
            other => Err(format!("{what}: expected an int, found {other:?}")),
        }
    }
    fn ints(&self, id: Id, what: &str) -> Result<Vec<i64>, String> {
        match &self.values[id] {
            Value::Tuple(items) | Value::List(items) => {
                items.iter().map(|&i| self.int(i, what)).collect()
            }
            other => Err(format!("{what}: expected a tuple of ints, found {other:?}")),
        }
    }
    fn tuple(&self, id: Id, what: &str) -> Result<Vec<Id>, String> {
        match &self.values[id] {
            Value::Tuple(items) => Ok(items.clone()),
            other => Err(format!("{what}: expected a tuple, found {other:?}")),
        }
    }

    fn run(&mut self) -> Result<Id, String> {
        loop {
            let at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return Err(format!("pickle protocol {proto} is not supported"));
                    }
                }
                0x95 => {
                    self.u64()?; // FRAME: a length hint only
                }
                b'.' => return self.pop(),
                b'(' => self.marks.push(self.stack.len()),
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                b'J' => {
                    let v = self.u32()? as i32;
                    self.push(Value::Int(i64::from(v)))?
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Value::Int(i64::from(v)))?
                }
                b'M' => {
                    let v = self.u16()?;
                    self.push(Value::Int(i64::from(v)))?
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a {
                        usize::from(self.u8()?)
                    } else {
                        self.u32()? as usize
                    };
                    if n > 8 {
                        return Err(format!("integer of {n} bytes at byte {at} is too large"));
                    }
                    let bytes = self.take(n)?;
                    let mut v: i64 = 0;
                    for (i, &b) in bytes.iter().enumerate() {
                        v |= i64::from(b) << (8 * i);
                    }
                    if n > 0 && n < 8 && bytes[n - 1] & 0x80 != 0 {
                        v -= 1i64 << (8 * n); // two's complement sign
                    }
                    self.push(Value::Int(v))?
                }
                b'G' => {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(self.take(8)?);
                    self.push(Value::Float(f64::from_be_bytes(a)))?
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        b'X' => u64::from(self.u32()?),
                        0x8c => u64::from(self.u8()?),
                        _ => self.u64()?,
                    };
                    let n = self.len_of(n)?;
                    let s = std::str::from_utf8(self.take(n)?)
                        .map_err(|_| format!("string at byte {at} is not UTF-8"))?;
                    self.push(Value::Str(s.to_string()))?
                }
                b'T' | b'U' => {
                    // Python 2 `str` (protocol < 3): bytes, read as Latin-1 text.
                    let n = if op == b'T' {
                        self.u32()? as usize
                    } else {
                        usize::from(self.u8()?)
                    };
                    let s = self.take(n)?.iter().map(|&b| char::from(b)).collect();
                    self.push(Value::Str(s))?
                }
                b'B' | b'C' | 0x8e => {
                    let n = match op {
                        b'B' => u64::from(self.u32()?),
                        b'C' => u64::from(self.u8()?),
                        _ => self.u64()?,
                    };
                    let n = self.len_of(n)?;
                    let b = self.take(n)?.to_vec();
                    self.push(Value::Bytes(b))?
                }
                b')' => self.push(Value::Tuple(Vec::new()))?,
                b']' => self.push(Value::List(Vec::new()))?,
                b'}' => self.push(Value::Dict(Vec::new()))?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(items))?
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    if self.stack.len() < n {
                        return Err("pickle stack underflow in TUPLEn".into());
                    }
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(Value::Tuple(items))?
                }
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(items))?
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let pairs = pairs(&items)?;
                    self.push(Value::Dict(pairs))?
                }
                b'a' => {
                    let v = self.pop()?;
                    let list = self.top()?;
                    self.extend_list(list, vec![v])?
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    let list = self.top()?;
                    self.extend_list(list, items)?
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let dict = self.top()?;
                    self.extend_dict(dict, vec![(k, v)])?
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let dict = self.top()?;
                    let items = pairs(&items)?;
                    self.extend_dict(dict, items)?
                }
                b'q' | b'r' | 0x94 => {
                    let key = match op {
                        b'q' => u64::from(self.u8()?),
                        b'r' => u64::from(self.u32()?),
                        _ => self.memo.len() as u64,
                    };
                    let top = self.top()?;
                    self.memo.insert(key, top);
                }
                b'h' | b'j' => {
                    let key = if op == b'h' {
                        u64::from(self.u8()?)
                    } else {
                        u64::from(self.u32()?)
                    };
                    let id = *self
                        .memo
                        .get(&key)
                        .ok_or_else(|| format!("memo key {key} used before it was set"))?;
                    self.stack.push(id);
                }
                b'0' => {
                    self.pop()?;
                }
                b'2' => {
                    let top = self.top()?;
                    self.stack.push(top);
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let g = Global::lookup(module, name).ok_or_else(|| refused(module, name))?;
                    self.push(Value::Global(g))?
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Value::Str(module), Value::Str(name)) =
                        (&self.values[module], &self.values[name])
                    else {
                        return Err("STACK_GLOBAL without two strings".into());
                    };
                    let g = Global::lookup(module, name).ok_or_else(|| refused(module, name))?;
                    self.push(Value::Global(g))?
                }
                b'R' => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let Value::Global(g) = self.values[callable].clone() else {
                        return Err(format!(
                            "REDUCE at byte {at} calls something that is not an allowed global"
                        ));
                    };
                    let args = self.tuple(args, "REDUCE arguments")?;
                    let v = self.call(g, &args)?;
                    self.push(v)?
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.storage(pid)?;
                    self.push(v)?
                }
                b'b' => {
                    // BUILD: `OrderedDict.__setstate__` / `__dict__` update. A state dict's only
                    // attribute is `_metadata` (module versions), which nothing here needs.
                    let _state = self.pop()?;
                    let target = self.top()?;
                    if !matches!(self.values[target], Value::Dict(_)) {
                        return Err(format!(
                            "BUILD at byte {at} sets the state of a {}; only dicts are accepted",
                            variant_name(&self.values[target])
                        ));
                    }
                }
                0x81 | 0x92 | b'o' | b'i' => {
                    return Err(format!(
                        "pickle constructs an object (opcode 0x{op:02x} at byte {at}); only \
                         tensors and plain containers are accepted"
                    ));
                }
                other => {
                    return Err(format!(
                        "unsupported pickle opcode 0x{other:02x} at byte {at}; only tensors and \
                         plain containers are accepted"
                    ));
                }
            }
        }
    }

    fn extend_list(&mut self, list: Id, items: Vec<Id>) -> Result<(), String> {
        match &mut self.values[list] {
            Value::List(l) => {
                l.extend(items);
                Ok(())
            }
            other => Err(format!("APPEND to a {}", variant_name(other))),
        }
    }

    fn extend_dict(&mut self, dict: Id, items: Vec<(Id, Id)>) -> Result<(), String> {
        match &mut self.values[dict] {
            Value::Dict(d) => {
                d.extend(items);
                Ok(())
            }
            other => Err(format!("SETITEM on a {}", variant_name(other))),
        }
    }

    /// `("storage", <storage class>, key, location, numel)`.
    fn storage(&self, pid: Id) -> Result<Value, String> {
        let items = self.tuple(pid, "persistent id")?;
        let [tag, class, key, _location, numel] = items.as_slice() else {
            return Err(format!(
                "persistent id has {} fields; PyTorch storages have 5",
                items.len()
            ));
        };
        let (Value::Str(tag), Value::Global(Global::Storage(kind)), Value::Str(key)) =
            (&self.values[*tag], &self.values[*class], &self.values[*key])
        else {
            return Err("persistent id is not a PyTorch storage reference".into());
        };
        if tag != "storage" {
            return Err(format!(
                "persistent id of kind `{tag}`; only `storage` is accepted"
            ));
        }
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("storage key `{key}` is not a plain name"));
        }
        let numel = self.int(*numel, "storage size")?;
        if numel < 0 {
            return Err(format!("storage `{key}` has a negative size"));
        }
        Ok(Value::Storage(StorageRef {
            key: key.clone(),
            kind: *kind,
            numel,
        }))
    }

    /// Interprets a call of an allowed global.
    fn call(&mut self, g: Global, args: &[Id]) -> Result<Value, String> {
        match g {
            Global::OrderedDict => {
                if !args.is_empty() {
                    return Err("OrderedDict called with arguments".into());
                }
                Ok(Value::Dict(Vec::new()))
            }
            Global::RebuildTensorV2 | Global::RebuildTensor => {
                // (storage, storage_offset, size, stride[, requires_grad, backward_hooks[, metadata]])
                if args.len() < 4 {
                    return Err("_rebuild_tensor with fewer than 4 arguments".into());
                }
                let Value::Storage(storage) = self.values[args[0]].clone() else {
                    return Err("_rebuild_tensor without a storage".into());
                };
                let offset = self.int(args[1], "storage offset")?;
                let shape = self.ints(args[2], "tensor size")?;
                let stride = self.ints(args[3], "tensor stride")?;
                check_view(&storage, offset, &shape, &stride)?;
                Ok(Value::Tensor(TensorRef {
                    storage,
                    offset,
                    shape,
                    stride,
                }))
            }
            Global::RebuildParameter | Global::RebuildParameterWithState => {
                // (data, requires_grad, backward_hooks[, state]): the data tensor.
                let data = *args.first().ok_or("_rebuild_parameter without data")?;
                match &self.values[data] {
                    Value::Tensor(t) => Ok(Value::Tensor(t.clone())),
                    _ => Err("_rebuild_parameter of something that is not a tensor".into()),
                }
            }
            Global::Storage(_) => Err("a storage class is called; only tensors are rebuilt".into()),
        }
    }
}

/// Checks that the strided view lies inside its storage.
fn check_view(
    storage: &StorageRef,
    offset: i64,
    shape: &[i64],
    stride: &[i64],
) -> Result<(), String> {
    if shape.len() != stride.len() {
        return Err(format!(
            "tensor on storage `{}` has {} sizes but {} strides",
            storage.key,
            shape.len(),
            stride.len()
        ));
    }
    if offset < 0 || shape.iter().any(|&s| s < 0) || stride.iter().any(|&s| s < 0) {
        return Err(format!(
            "tensor on storage `{}` has a negative size, stride or offset",
            storage.key
        ));
    }
    if shape.contains(&0) {
        return Ok(());
    }
    let last = shape
        .iter()
        .zip(stride)
        .try_fold(offset, |acc, (&n, &s)| {
            (n - 1).checked_mul(s).and_then(|d| acc.checked_add(d))
        })
        .ok_or_else(|| format!("tensor on storage `{}` overflows", storage.key))?;
    if last >= storage.numel {
        return Err(format!(
            "tensor reaches element {last} of storage `{}`, which holds {}",
            storage.key, storage.numel
        ));
    }
    Ok(())
}

fn pairs(items: &[Id]) -> Result<Vec<(Id, Id)>, String> {
    if !items.len().is_multiple_of(2) {
        return Err("dict items of odd length".into());
    }
    Ok(items.chunks(2).map(|kv| (kv[0], kv[1])).collect())
}

fn refused(module: &str, name: &str) -> String {
    format!(
        "the pickle refers to `{module}.{name}`; only tensors and plain containers are read \
         (a checkpoint that names other Python objects could run code when loaded by Python; \
         save the state dict alone, or convert the file to safetensors)"
    )
}

fn variant_name(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "bool",
        Value::Int(_) => "int",
        Value::Float(_) => "float",
        Value::Str(_) => "str",
        Value::Bytes(_) => "bytes",
        Value::Tuple(_) => "tuple",
        Value::List(_) => "list",
        Value::Dict(_) => "dict",
        Value::Tensor(_) => "tensor",
        Value::Global(_) => "class",
        Value::Storage(_) => "storage",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_values_are_read() {
        // pickle.dumps({"a": [1, -2, 300, 70000], "b": (True, None, 1.5), "c": "é"}, protocol=2)
        let data = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00eX\x01\x00\x00\x00bq\x03\x88NG?\xf8\x00\x00\x00\x00\x00\x00\x87q\x04X\x01\x00\x00\x00cq\x05X\x02\x00\x00\x00\xc3\xa9q\x06u.";
        let u = unpickle(data).unwrap();
        let Value::Dict(items) = u.get(u.root) else {
            panic!("not a dict")
        };
        assert_eq!(items.len(), 3);
        let Value::List(list) = u.get(items[0].1) else {
            panic!()
        };
        let ints: Vec<_> = list.iter().map(|&i| u.get(i).clone()).collect();
        assert_eq!(
            ints,
            [
                Value::Int(1),
                Value::Int(-2),
                Value::Int(300),
                Value::Int(70000)
            ]
        );
        assert_eq!(u.str(items[2].1), Some("é"));
    }

    #[test]
    fn globals_outside_the_allowlist_are_refused() {
        // GLOBAL 'posix system', then REDUCE: never called.
        let data = b"\x80\x02cposix\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.";
        let err = unpickle(data).unwrap_err();
        assert!(err.contains("`posix.system`"), "{err}");
        let stack_global = b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93.";
        let err = unpickle(stack_global).unwrap_err();
        assert!(err.contains("`builtins.eval`"), "{err}");
        let newobj = b"\x80\x02ccollections\nOrderedDict\n)\x81.";
        assert!(
            unpickle(newobj)
                .unwrap_err()
                .contains("constructs an object")
        );
    }

    #[test]
    fn truncated_and_malformed_pickles_are_errors() {
        assert!(unpickle(b"\x80\x02X\x10\x00\x00\x00abc").is_err());
        assert!(unpickle(b"\x80\x02e.").is_err());
        assert!(unpickle(b"").is_err());
        assert!(unpickle(b"\x80\x02\xff.").unwrap_err().contains("0xff"));
    }
}
