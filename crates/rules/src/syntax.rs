//! The rule language's lexer and parser: text in, a [`File`] of located [`Item`]s out.
//!
//! Call [`parse`] with the whole text. It never stops at the first mistake: every line with an error yields one
//! [`Diagnostic`] (line:column and what was expected) and parsing resumes at the next line. The checker
//! ([`mod@crate::compile`]) then resolves names, units, arities and types.
//!
//! Grammar (one statement per line; inside parentheses a statement may continue over several lines):
//!
//! ```text
//! line      := '[' section ']' | name ':' expr | name '->' target | action | (empty)
//! section   := 'manual' | 'contextEnter' | 'contextExit'
//! target    := name | action
//! action    := 'load' '(' name {',' name} ')' | 'unload' '(' (name | 'ALL') {',' name} ')'
//!            | 'replace' '(' name ',' name ')'
//! expr      := number [duration unit] | string | 'true' | 'false' | name | name '(' [expr {',' expr}] ')'
//! comment   := '#' or '//' up to the end of the line
//! ```

use crate::diag::{Diagnostic, Span};
use flexstack_core::Value;
use std::fmt;

/// Deepest nesting of calls the parser accepts (keeps recursion bounded on hostile input).
pub const MAX_NESTING: usize = 200;

/// The section a statement was written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Section {
    /// Before any section header: loaded when the text is loaded.
    Default,
    /// `[manual]`: defined, loaded only by `load(...)`.
    Manual,
    /// `[contextEnter]`: watchers that load rules when their condition becomes true.
    ContextEnter,
    /// `[contextExit]`: watchers that unload rules when their condition becomes true.
    ContextExit,
}

impl Section {
    /// The name written between brackets.
    pub fn name(self) -> &'static str {
        match self {
            Section::Default => "default",
            Section::Manual => "manual",
            Section::ContextEnter => "contextEnter",
            Section::ContextExit => "contextExit",
        }
    }
}

/// A name with where it was written.
#[derive(Clone, Debug, PartialEq)]
pub struct Name {
    /// The text of the name.
    pub text: String,
    /// Where it starts.
    pub span: Span,
}

/// An expression: a literal, a rule name or a call of a unit.
#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    /// Where the expression starts.
    pub span: Span,
    /// What it is.
    pub kind: ExprKind,
}

/// The forms of [`Expr`].
#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    /// A number, boolean or string literal.
    Literal(Value),
    /// A duration literal (`200ms`, `5s`), in nanoseconds.
    Duration(u64),
    /// A reference to a rule by name.
    Name(String),
    /// A call of a unit (`History(x, 4)`, `get("...")`).
    Call {
        /// The unit's name as written.
        name: String,
        /// Its arguments.
        args: Vec<Expr>,
    },
}

/// A runtime keyword: `load`, `unload` or `replace`.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// `load(a, b)`: load rules (with their dependencies).
    Load(Vec<Name>),
    /// `unload(a)`; `None` stands for `ALL`.
    Unload(Option<Vec<Name>>),
    /// `replace(old, new)`.
    Replace(Name, Name),
}

/// What a trigger fires.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// A rule, evaluated by query.
    Rule(Name),
    /// A runtime keyword.
    Action(Action),
}

/// One statement.
#[derive(Clone, Debug, PartialEq)]
pub enum ItemKind {
    /// `name: expr`.
    Def {
        /// The rule's name.
        name: Name,
        /// Its expression.
        expr: Expr,
    },
    /// `source -> target`.
    Trigger {
        /// The rule whose events fire the target.
        source: Name,
        /// What is fired.
        target: Target,
    },
    /// A keyword on a line of its own, run when the text is loaded.
    Action(Action),
}

/// One statement with its section and place.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    /// The section it was written in.
    pub section: Section,
    /// Where the statement starts.
    pub span: Span,
    /// The statement.
    pub kind: ItemKind,
}

/// A parsed text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct File {
    /// The statements in written order.
    pub items: Vec<Item>,
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Lit(Value),
    Duration(u64),
    Colon,
    Arrow,
    LParen,
    RParen,
    Comma,
    LBracket,
    RBracket,
    Newline,
    Eof,
    /// Where a lexical error was reported: the rest of its line is skipped without more messages.
    Bad,
}

impl fmt::Display for Tok {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Ident(s) => write!(f, "`{s}`"),
            Tok::Str(s) => write!(f, "string {s:?}"),
            Tok::Lit(v) => write!(f, "number {}", crate::units::show_value(v)),
            Tok::Duration(ns) => write!(f, "duration {ns}ns"),
            Tok::Colon => f.write_str("`:`"),
            Tok::Arrow => f.write_str("`->`"),
            Tok::LParen => f.write_str("`(`"),
            Tok::RParen => f.write_str("`)`"),
            Tok::Comma => f.write_str("`,`"),
            Tok::LBracket => f.write_str("`[`"),
            Tok::RBracket => f.write_str("`]`"),
            Tok::Newline => f.write_str("end of line"),
            Tok::Eof => f.write_str("end of text"),
            Tok::Bad => f.write_str("an invalid token"),
        }
    }
}

/// Lexes the whole text; a lexical error becomes a diagnostic and the rest of its line is skipped.
fn lex(text: &str, diags: &mut Vec<Diagnostic>) -> Vec<(Tok, Span)> {
    let chars: Vec<char> = text.chars().collect();
    let mut toks = Vec::new();
    let (mut i, mut line, mut col) = (0usize, 1u32, 1u32);
    let mut depth = 0usize;
    let skip_line = |i: &mut usize, col: &mut u32| {
        while *i < chars.len() && chars[*i] != '\n' {
            *i += 1;
            *col += 1;
        }
    };
    while i < chars.len() {
        let c = chars[i];
        let span = Span { line, column: col };
        let next = chars.get(i + 1).copied();
        match c {
            '\n' => {
                // Inside parentheses, an indented next line continues the statement; anything else ends it.
                let continues = depth > 0 && matches!(next, Some(' ' | '\t'));
                if !continues {
                    toks.push((Tok::Newline, span));
                    depth = 0;
                }
                i += 1;
                line += 1;
                col = 1;
                continue;
            }
            ' ' | '\t' | '\r' => {}
            '#' => {
                skip_line(&mut i, &mut col);
                continue;
            }
            '/' if next == Some('/') => {
                skip_line(&mut i, &mut col);
                continue;
            }
            ':' => toks.push((Tok::Colon, span)),
            ',' => toks.push((Tok::Comma, span)),
            '[' => toks.push((Tok::LBracket, span)),
            ']' => toks.push((Tok::RBracket, span)),
            '(' => {
                depth += 1;
                toks.push((Tok::LParen, span));
            }
            ')' => {
                depth = depth.saturating_sub(1);
                toks.push((Tok::RParen, span));
            }
            '-' if next == Some('>') => {
                toks.push((Tok::Arrow, span));
                i += 2;
                col += 2;
                continue;
            }
            '"' => {
                let mut s = String::new();
                let mut j = i + 1;
                let mut closed = false;
                let mut bad_escape = None;
                while j < chars.len() && chars[j] != '\n' {
                    match chars[j] {
                        '"' => {
                            closed = true;
                            break;
                        }
                        '\\' => {
                            j += 1;
                            match chars.get(j) {
                                Some('"') => s.push('"'),
                                Some('\\') => s.push('\\'),
                                Some('n') => s.push('\n'),
                                Some('t') => s.push('\t'),
                                // A backslash at the end of the line escapes nothing: the string is unterminated.
                                Some('\n') | None => break,
                                Some(&other) => bad_escape = bad_escape.or(Some(other)),
                            }
                        }
                        ch => s.push(ch),
                    }
                    j += 1;
                }
                if !closed {
                    diags
                        .push(Diagnostic::error(span, "unterminated string: expected a closing `\"` on the same line"));
                    toks.push((Tok::Bad, span));
                    col += (j - i) as u32;
                    i = j;
                    continue;
                }
                if let Some(e) = bad_escape {
                    // Shown escaped: a control character must not break the one-line message.
                    let what = format!("`\\{}`", e.escape_debug());
                    diags.push(Diagnostic::error(
                        span,
                        format!("bad escape {what} in string: expected \\\" \\\\ \\n or \\t"),
                    ));
                }
                toks.push((Tok::Str(s), span));
                col += (j + 1 - i) as u32;
                i = j + 1;
                continue;
            }
            c if c.is_ascii_digit() || (c == '-' && next.is_some_and(|d| d.is_ascii_digit())) => {
                let start = i;
                let mut j = i + 1;
                while j < chars.len() && (chars[j].is_ascii_digit() || chars[j] == '.') {
                    j += 1;
                }
                // An exponent: e or E, an optional sign, digits.
                if matches!(chars.get(j), Some('e' | 'E')) {
                    let k = j + 1 + usize::from(matches!(chars.get(j + 1), Some('+' | '-')));
                    if chars.get(k).is_some_and(|c| c.is_ascii_digit()) {
                        j = k;
                        while j < chars.len() && chars[j].is_ascii_digit() {
                            j += 1;
                        }
                    }
                }
                let number: String = chars[start..j].iter().collect();
                let ustart = j;
                while j < chars.len() && chars[j].is_ascii_alphabetic() {
                    j += 1;
                }
                let unit: String = chars[ustart..j].iter().collect();
                col += (j - i) as u32;
                i = j;
                match lex_number(&number, &unit) {
                    Ok(t) => toks.push((t, span)),
                    Err(m) => {
                        diags.push(Diagnostic::error(span, m));
                        toks.push((Tok::Bad, span));
                        skip_line(&mut i, &mut col);
                    }
                }
                continue;
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let mut j = i;
                while j < chars.len() && (chars[j].is_ascii_alphanumeric() || chars[j] == '_') {
                    j += 1;
                }
                let word: String = chars[i..j].iter().collect();
                col += (j - i) as u32;
                i = j;
                toks.push((
                    match word.as_str() {
                        "true" => Tok::Lit(Value::Bool(true)),
                        "false" => Tok::Lit(Value::Bool(false)),
                        _ => Tok::Ident(word),
                    },
                    span,
                ));
                continue;
            }
            other => {
                diags.push(Diagnostic::error(
                    span,
                    format!("unexpected character {other:?}: expected a name, a number, a string, `:`, `->`, `(`, `)`, `,` or a comment"),
                ));
                toks.push((Tok::Bad, span));
                skip_line(&mut i, &mut col);
                continue;
            }
        }
        i += 1;
        col += 1;
    }
    toks.push((Tok::Eof, Span { line, column: col }));
    toks
}

/// A number with an optional duration unit.
fn lex_number(number: &str, unit: &str) -> Result<Tok, String> {
    let bad = || format!("bad number `{number}{unit}`: expected digits with at most one `.` and an optional exponent");
    let mantissa = number.split(['e', 'E']).next().unwrap_or("");
    if mantissa.matches('.').count() > 1 || mantissa.ends_with('.') {
        return Err(bad());
    }
    if unit.is_empty() {
        if number.contains(['.', 'e', 'E']) {
            let v: f64 = number.parse().map_err(|_| bad())?;
            if !v.is_finite() {
                return Err(format!("number `{number}` is out of range"));
            }
            return Ok(Tok::Lit(Value::F64(v)));
        }
        if let Ok(v) = number.parse::<u64>() {
            return Ok(Tok::Lit(Value::U64(v)));
        }
        // Only negative integers are i64 ("-0" is 0).
        return match number.parse::<i64>() {
            Ok(0) => Ok(Tok::Lit(Value::U64(0))),
            Ok(v) => Ok(Tok::Lit(Value::I64(v))),
            Err(_) => Err(format!("number `{number}` is out of range")),
        };
    }
    let scale: f64 = match unit {
        "ns" => 1.0,
        "us" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        "m" | "min" => 60e9,
        "h" => 3600e9,
        _ => return Err(format!("unknown duration unit `{unit}` after {number}: expected ns, us, ms, s, min or h")),
    };
    let v: f64 = number.parse().map_err(|_| bad())?;
    let ns = v * scale;
    if !(0.0..=1e18).contains(&ns) {
        return Err(format!("duration `{number}{unit}` is out of range: expected 0 to about 31 years"));
    }
    Ok(Tok::Duration(ns.round() as u64))
}

struct Parser {
    toks: Vec<(Tok, Span)>,
    pos: usize,
    depth: usize,
}

type PResult<T> = Result<T, Diagnostic>;

impl Parser {
    fn peek(&self) -> &Tok {
        &self.toks[self.pos].0
    }
    fn span(&self) -> Span {
        self.toks[self.pos].1
    }
    fn bump(&mut self) -> (Tok, Span) {
        let t = self.toks[self.pos].clone();
        if self.pos + 1 < self.toks.len() {
            self.pos += 1;
        }
        t
    }
    fn expect(&mut self, want: Tok, what: &str) -> PResult<Span> {
        if *self.peek() == want {
            Ok(self.bump().1)
        } else {
            Err(Diagnostic::error(self.span(), format!("expected {what}, found {}", self.peek())))
        }
    }
    fn name(&mut self, what: &str) -> PResult<Name> {
        match self.peek().clone() {
            Tok::Ident(text) => {
                let span = self.bump().1;
                Ok(Name { text, span })
            }
            other => Err(Diagnostic::error(self.span(), format!("expected {what}, found {other}"))),
        }
    }
    fn end_of_statement(&mut self) -> PResult<()> {
        match self.peek() {
            Tok::Newline | Tok::Eof => Ok(()),
            other => {
                Err(Diagnostic::error(self.span(), format!("expected end of line after the statement, found {other}")))
            }
        }
    }
    /// True if the current line holds a token a lexical error was reported at.
    fn line_is_bad(&self) -> bool {
        self.toks[self.pos..]
            .iter()
            .take_while(|(t, _)| !matches!(t, Tok::Newline | Tok::Eof))
            .any(|(t, _)| *t == Tok::Bad)
    }
    fn skip_line(&mut self) {
        while !matches!(self.peek(), Tok::Newline | Tok::Eof) {
            self.bump();
        }
    }

    fn expr(&mut self) -> PResult<Expr> {
        let span = self.span();
        match self.peek().clone() {
            Tok::Lit(v) => {
                self.bump();
                Ok(Expr { span, kind: ExprKind::Literal(v) })
            }
            Tok::Str(s) => {
                self.bump();
                Ok(Expr { span, kind: ExprKind::Literal(Value::Str(s)) })
            }
            Tok::Duration(ns) => {
                self.bump();
                Ok(Expr { span, kind: ExprKind::Duration(ns) })
            }
            Tok::Ident(name) => {
                self.bump();
                if *self.peek() != Tok::LParen {
                    return Ok(Expr { span, kind: ExprKind::Name(name) });
                }
                self.bump();
                self.depth += 1;
                if self.depth > MAX_NESTING {
                    return Err(Diagnostic::error(span, format!("calls nested deeper than {MAX_NESTING}: expected a flatter expression (name the inner parts as rules)")));
                }
                let mut args = Vec::new();
                if *self.peek() != Tok::RParen {
                    loop {
                        args.push(self.expr()?);
                        match self.peek() {
                            Tok::Comma => {
                                self.bump();
                            }
                            Tok::RParen => break,
                            other => {
                                return Err(Diagnostic::error(
                                    self.span(),
                                    format!("expected `,` or `)` in the arguments of {name}, found {other}"),
                                ))
                            }
                        }
                    }
                }
                self.bump();
                self.depth -= 1;
                Ok(Expr { span, kind: ExprKind::Call { name, args } })
            }
            other => Err(Diagnostic::error(
                span,
                format!("expected an expression (a number, a string, a rule name or a unit call), found {other}"),
            )),
        }
    }

    /// `load(...)`, `unload(...)`, `replace(...)` after the keyword has been read.
    fn action(&mut self, keyword: &Name) -> PResult<Action> {
        self.expect(Tok::LParen, &format!("`(` after {}", keyword.text))?;
        let mut names = vec![self.name(&format!("a rule name in {}(...)", keyword.text))?];
        while *self.peek() == Tok::Comma {
            self.bump();
            names.push(self.name(&format!("a rule name in {}(...)", keyword.text))?);
        }
        self.expect(Tok::RParen, &format!("`,` or `)` in {}(...)", keyword.text))?;
        match keyword.text.as_str() {
            "load" => {
                if let Some(all) = names.iter().find(|n| n.text == "ALL") {
                    return Err(Diagnostic::error(all.span, "ALL is only allowed in unload(ALL): expected rule names"));
                }
                Ok(Action::Load(names))
            }
            "unload" => {
                if names.iter().any(|n| n.text == "ALL") {
                    if names.len() > 1 {
                        return Err(Diagnostic::error(
                            keyword.span,
                            "unload(ALL) takes no other names: expected unload(ALL)",
                        ));
                    }
                    Ok(Action::Unload(None))
                } else {
                    Ok(Action::Unload(Some(names)))
                }
            }
            _ => {
                if names.len() != 2 {
                    return Err(Diagnostic::error(
                        keyword.span,
                        format!("replace takes 2 rule names (old, new), got {}", names.len()),
                    ));
                }
                let new = names.pop().expect("two names");
                let old = names.pop().expect("two names");
                Ok(Action::Replace(old, new))
            }
        }
    }

    fn statement(&mut self, section: Section) -> PResult<Option<Item>> {
        let span = self.span();
        match self.peek().clone() {
            Tok::Newline | Tok::Eof => Ok(None),
            Tok::Ident(_) => {
                let name = self.name("a rule name")?;
                let is_keyword = matches!(name.text.as_str(), "load" | "unload" | "replace");
                match self.peek() {
                    Tok::LParen if is_keyword => {
                        let action = self.action(&name)?;
                        self.end_of_statement()?;
                        Ok(Some(Item { section, span, kind: ItemKind::Action(action) }))
                    }
                    Tok::Colon => {
                        if is_keyword || name.text == "ALL" {
                            return Err(Diagnostic::error(
                                name.span,
                                format!("`{}` is a keyword: expected another rule name", name.text),
                            ));
                        }
                        self.bump();
                        let expr = self.expr()?;
                        self.end_of_statement()?;
                        Ok(Some(Item { section, span, kind: ItemKind::Def { name, expr } }))
                    }
                    Tok::Arrow => {
                        self.bump();
                        let target_name =
                            self.name("a rule name, load(...), unload(...) or replace(...) after `->`")?;
                        let target = if matches!(target_name.text.as_str(), "load" | "unload" | "replace")
                            && *self.peek() == Tok::LParen
                        {
                            Target::Action(self.action(&target_name)?)
                        } else {
                            Target::Rule(target_name)
                        };
                        self.end_of_statement()?;
                        Ok(Some(Item { section, span, kind: ItemKind::Trigger { source: name, target } }))
                    }
                    other => Err(Diagnostic::error(
                        self.span(),
                        format!("expected `:` (a definition) or `->` (a trigger) after `{}`, found {other}", name.text),
                    )),
                }
            }
            other => Err(Diagnostic::error(
                span,
                format!(
                    "expected a statement (`name: expr`, `name -> target`, a keyword or `[section]`), found {other}"
                ),
            )),
        }
    }
}

/// Parses a whole text. Returns the statements and every syntax error found (one per line at most).
pub fn parse(text: &str) -> (File, Vec<Diagnostic>) {
    let mut diags = Vec::new();
    let toks = lex(text, &mut diags);
    let mut p = Parser { toks, pos: 0, depth: 0 };
    let mut file = File::default();
    let mut section = Section::Default;
    loop {
        match p.peek() {
            Tok::Eof => break,
            Tok::Newline => {
                p.bump();
                continue;
            }
            _ if p.line_is_bad() => p.skip_line(),
            Tok::LBracket => {
                let result = (|| {
                    p.bump();
                    let name = p.name("a section name (manual, contextEnter or contextExit)")?;
                    let s = match name.text.as_str() {
                        "manual" => Section::Manual,
                        "contextEnter" => Section::ContextEnter,
                        "contextExit" => Section::ContextExit,
                        other => {
                            return Err(Diagnostic::error(
                                name.span,
                                format!(
                                    "unknown section [{other}]: expected [manual], [contextEnter] or [contextExit]"
                                ),
                            ))
                        }
                    };
                    p.expect(Tok::RBracket, "`]`")?;
                    p.end_of_statement()?;
                    Ok(s)
                })();
                match result {
                    Ok(s) => section = s,
                    Err(d) => {
                        diags.push(d);
                        p.skip_line();
                    }
                }
            }
            _ => {
                p.depth = 0;
                match p.statement(section) {
                    Ok(Some(item)) => file.items.push(item),
                    Ok(None) => {}
                    Err(d) => {
                        diags.push(d);
                        p.skip_line();
                    }
                }
            }
        }
    }
    // Lexical errors come first in the vector but belong in line order with the others.
    diags.sort_by_key(|d| d.span);
    (file, diags)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_definitions_triggers_sections_and_keywords() {
        let text = "a: get(\"x.y\") # comment\n[manual]\nb: History(a,\n  4)\na -> b\n// c\n[contextEnter]\nc: get(\"app.q.on\")\nc -> load(b, a)\nunload(ALL)\nreplace(a, b)\nt: Timer(200ms)\n";
        let (f, d) = parse(text);
        assert!(d.is_empty(), "{d:?}");
        assert_eq!(f.items.len(), 8);
        assert_eq!(f.items[1].section, Section::Manual);
        assert_eq!(f.items[1].span, Span { line: 3, column: 1 });
        assert!(matches!(&f.items[2].kind, ItemKind::Trigger { target: Target::Rule(n), .. } if n.text == "b"));
        assert!(
            matches!(&f.items[4].kind, ItemKind::Trigger { target: Target::Action(Action::Load(v)), .. } if v.len() == 2)
        );
        assert!(matches!(&f.items[5].kind, ItemKind::Action(Action::Unload(None))));
        assert!(matches!(&f.items[7].kind, ItemKind::Def { expr: Expr { kind: ExprKind::Call { args, .. }, .. }, .. }
            if args[0].kind == ExprKind::Duration(200_000_000)));
    }

    #[test]
    fn errors_have_line_column_and_expectation() {
        let (_, d) = parse("a: get(\"x\"\nb get(1)\nc: 5xs\n[weird]\nd: \"open\ne: Less(1 2)\n");
        let shown: Vec<String> = d.iter().map(|d| d.to_string()).collect();
        assert!(shown[0].starts_with("1:11: error: expected `,` or `)`"), "{shown:?}");
        assert!(shown[1].starts_with("2:3: error: expected `:` (a definition) or `->`"), "{shown:?}");
        assert!(shown[2].starts_with("3:4: error: unknown duration unit `xs`"), "{shown:?}");
        assert!(shown[3].starts_with("4:2: error: unknown section [weird]"), "{shown:?}");
        assert!(shown[4].starts_with("5:4: error: unterminated string"), "{shown:?}");
        assert!(shown[5].starts_with("6:11: error: expected `,` or `)`"), "{shown:?}");
        assert_eq!(shown.len(), 6, "{shown:?}");
    }

    /// Found by the libFuzzer target `rules`: a backslash before the end of the line took the newline into the
    /// string, and the message about it held that newline.
    #[test]
    fn a_backslash_at_the_end_of_a_line_ends_the_string_unterminated() {
        let (_, d) = parse("a: get(\"x\\\nb: 1\")\nc: get(\"y\\\u{f}\")\n");
        let shown: Vec<String> = d.iter().map(|d| d.to_string()).collect();
        assert!(shown[0].starts_with("1:8: error: unterminated string"), "{shown:?}");
        assert!(shown.iter().any(|m| m.contains("bad escape `\\\\u{f}`")), "{shown:?}");
        assert!(shown.iter().all(|m| !m.contains(|c: char| c.is_control())), "{shown:?}");
    }

    #[test]
    fn numbers_and_nesting_limits() {
        let (f, d) = parse("a: Less(-3, 2.5)\nb: 18446744073709551615\n");
        assert!(d.is_empty(), "{d:?}");
        assert!(matches!(&f.items[0].kind, ItemKind::Def { expr: Expr { kind: ExprKind::Call { args, .. }, .. }, .. }
            if args[0].kind == ExprKind::Literal(Value::I64(-3)) && args[1].kind == ExprKind::Literal(Value::F64(2.5))));
        let deep = format!("a: {}1{}", "Not(".repeat(MAX_NESTING + 1), ")".repeat(MAX_NESTING + 1));
        let (_, d) = parse(&deep);
        assert!(d[0].message.contains("nested deeper"), "{d:?}");
        let (_, d) = parse("a: 1.2.3\nb: 99999999999999999999\n");
        assert_eq!(d.len(), 2, "{d:?}");
    }
}
