//! A1111-style prompt syntax: `(text)` ×1.1, `[text]` ÷1.1, `(text:1.3)` explicit weight, nesting
//! multiplies, `\(` `\)` `\[` `\]` `\\` escapes, and `BREAK` starting a new 75-token chunk.
//!
//! Semantics follow AUTOMATIC1111's `modules/prompt_parser.py::parse_prompt_attention` (AGPL;
//! re-implemented from its documented behaviour): unbalanced openers are closed at the end,
//! stray closers are literal, consecutive fragments of equal weight are merged.

/// One piece of prompt text with its attention weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Fragment {
    pub text: String,
    pub weight: f64,
}

/// A parsed prompt: one fragment list per `BREAK`-separated section.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedPrompt {
    pub sections: Vec<Vec<Fragment>>,
}

const ROUND: f64 = 1.1;
const SQUARE: f64 = 1.0 / 1.1;

/// Parses A1111 syntax.
pub fn parse(prompt: &str) -> ParsedPrompt {
    let sections = split_break(prompt)
        .into_iter()
        .map(|s| parse_attention(&s))
        .collect();
    ParsedPrompt { sections }
}

/// Splits on the word `BREAK` (whole word, case-sensitive), eating surrounding whitespace.
fn split_break(prompt: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    let chars: Vec<char> = prompt.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let boundary_before = i == 0 || !is_word(chars[i - 1]);
        if boundary_before
            && chars[i..].starts_with(&['B', 'R', 'E', 'A', 'K'])
            && chars.get(i + 5).is_none_or(|&c| !is_word(c))
        {
            out.push(current.trim_end().to_string());
            current = String::new();
            i += 5;
            while i < chars.len() && chars[i].is_whitespace() {
                i += 1;
            }
            continue;
        }
        current.push(chars[i]);
        i += 1;
    }
    out.push(current);
    out
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `:` followed by a number and `)`; returns the number and the characters consumed.
fn explicit_weight(chars: &[char]) -> Option<(f64, usize)> {
    let mut i = 1;
    while i < chars.len() && chars[i].is_whitespace() {
        i += 1;
    }
    let start = i;
    if i < chars.len() && (chars[i] == '+' || chars[i] == '-') {
        i += 1;
    }
    while i < chars.len() && (chars[i].is_ascii_digit() || chars[i] == '.') {
        i += 1;
    }
    let number: String = chars[start..i].iter().collect();
    while i < chars.len() && chars[i].is_whitespace() {
        i += 1;
    }
    if i < chars.len() && chars[i] == ')' {
        number.parse::<f64>().ok().map(|w| (w, i + 1))
    } else {
        None
    }
}

fn parse_attention(text: &str) -> Vec<Fragment> {
    let chars: Vec<char> = text.chars().collect();
    let mut res: Vec<(String, f64)> = Vec::new();
    let mut round: Vec<usize> = Vec::new();
    let mut square: Vec<usize> = Vec::new();
    let multiply = |res: &mut Vec<(String, f64)>, start: usize, m: f64| {
        for r in res.iter_mut().skip(start) {
            r.1 *= m;
        }
    };
    let push = |res: &mut Vec<(String, f64)>, s: String| res.push((s, 1.0));
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\\' if i + 1 < chars.len() && matches!(chars[i + 1], '(' | ')' | '[' | ']' | '\\') => {
                push(&mut res, chars[i + 1].to_string());
                i += 2;
            }
            '(' => {
                round.push(res.len());
                i += 1;
            }
            '[' => {
                square.push(res.len());
                i += 1;
            }
            ':' => {
                if let (Some((w, used)), Some(&start)) =
                    (explicit_weight(&chars[i..]), round.last())
                {
                    round.pop();
                    multiply(&mut res, start, w);
                    i += used;
                } else {
                    push(&mut res, ":".into());
                    i += 1;
                }
            }
            ')' => {
                match round.pop() {
                    Some(start) => multiply(&mut res, start, ROUND),
                    None => push(&mut res, ")".into()),
                }
                i += 1;
            }
            ']' => {
                match square.pop() {
                    Some(start) => multiply(&mut res, start, SQUARE),
                    None => push(&mut res, "]".into()),
                }
                i += 1;
            }
            _ => {
                let mut s = String::new();
                while i < chars.len() && !matches!(chars[i], '\\' | '(' | ')' | '[' | ']' | ':') {
                    s.push(chars[i]);
                    i += 1;
                }
                if s.is_empty() {
                    // A lone backslash not starting an escape is literal.
                    s.push(chars[i]);
                    i += 1;
                }
                push(&mut res, s);
            }
        }
    }
    for start in round.drain(..).rev() {
        multiply(&mut res, start, ROUND);
    }
    for start in square.drain(..).rev() {
        multiply(&mut res, start, SQUARE);
    }
    let mut out: Vec<Fragment> = Vec::new();
    for (text, weight) in res {
        match out.last_mut() {
            Some(last) if last.weight == weight => last.text.push_str(&text),
            _ => out.push(Fragment { text, weight }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frags(p: &str) -> Vec<(String, f64)> {
        parse(p).sections[0]
            .iter()
            .map(|f| (f.text.clone(), f.weight))
            .collect()
    }

    #[test]
    fn weights_follow_a1111() {
        assert_eq!(frags("a cat"), vec![("a cat".into(), 1.0)]);
        assert_eq!(
            frags("a (red:1.5) apple"),
            vec![
                ("a ".into(), 1.0),
                ("red".into(), 1.5),
                (" apple".into(), 1.0)
            ]
        );
        assert_eq!(
            frags("((masterpiece)), [x]"),
            vec![
                ("masterpiece".into(), 1.1 * 1.1),
                (", ".into(), 1.0),
                ("x".into(), 1.0 / 1.1)
            ]
        );
        assert_eq!(
            frags("(a (b:2) c)"),
            vec![
                ("a ".into(), 1.1),
                ("b".into(), 2.0 * 1.1),
                (" c".into(), 1.1)
            ]
        );
        assert_eq!(
            frags("a \\(literal\\) b"),
            vec![("a (literal) b".into(), 1.0)]
        );
        assert_eq!(frags("time: 5"), vec![("time: 5".into(), 1.0)]);
        assert_eq!(
            frags("unclosed (word"),
            vec![("unclosed ".into(), 1.0), ("word".into(), 1.1)]
        );
    }

    #[test]
    fn break_splits_sections() {
        let p = parse("a cat BREAK a dog, BREAKFAST");
        assert_eq!(p.sections.len(), 2);
        assert_eq!(p.sections[0][0].text, "a cat");
        assert_eq!(p.sections[1][0].text, "a dog, BREAKFAST");
    }
}
