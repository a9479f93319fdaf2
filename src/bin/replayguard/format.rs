//! `consume --format`: a kcat-like record format.

use std::io::Write;

use rdkafka::Message;
use rdkafka::message::Headers;

/// One piece of a parsed format.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(Vec<u8>),
    Value,
    Key,
    Topic,
    Partition,
    Offset,
    Headers,
}

/// A parsed `--format`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Format(Vec<Piece>);

impl std::str::FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut text = Vec::new();
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            let field = match c {
                '%' => match chars.next() {
                    Some('s') => Piece::Value,
                    Some('k') => Piece::Key,
                    Some('t') => Piece::Topic,
                    Some('p') => Piece::Partition,
                    Some('o') => Piece::Offset,
                    Some('h') => Piece::Headers,
                    Some('%') => {
                        text.push(b'%');
                        continue;
                    }
                    Some(other) => {
                        return Err(format!(
                            "unknown field %{other} in --format: use %s %k %t %p %o %h or %%"
                        ));
                    }
                    None => {
                        return Err("--format ends with a lone %; write %% for a percent".into());
                    }
                },
                '\\' => {
                    let escaped = match chars.next() {
                        Some('n') => '\n',
                        Some('t') => '\t',
                        Some('r') => '\r',
                        Some('0') => '\0',
                        Some('\\') => '\\',
                        Some(other) => {
                            return Err(format!(
                                "unknown escape \\{other} in --format: use \\n \\t \\r \\0 or \\\\"
                            ));
                        }
                        None => return Err("--format ends with a lone \\; write \\\\".into()),
                    };
                    let mut buf = [0u8; 4];
                    text.extend_from_slice(escaped.encode_utf8(&mut buf).as_bytes());
                    continue;
                }
                c => {
                    let mut buf = [0u8; 4];
                    text.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    continue;
                }
            };
            if !text.is_empty() {
                pieces.push(Piece::Text(std::mem::take(&mut text)));
            }
            pieces.push(field);
        }
        if !text.is_empty() {
            pieces.push(Piece::Text(text));
        }
        Ok(Format(pieces))
    }
}

impl Format {
    /// Renders `m` into `out`. A null key, value or header value renders as
    /// nothing.
    pub fn render(&self, m: &impl Message, out: &mut Vec<u8>) {
        for piece in &self.0 {
            match piece {
                Piece::Text(t) => out.extend_from_slice(t),
                Piece::Value => out.extend_from_slice(m.payload().unwrap_or_default()),
                Piece::Key => out.extend_from_slice(m.key().unwrap_or_default()),
                Piece::Topic => out.extend_from_slice(m.topic().as_bytes()),
                // Writing into a Vec cannot fail.
                Piece::Partition => {
                    let _ = write!(out, "{}", m.partition());
                }
                Piece::Offset => {
                    let _ = write!(out, "{}", m.offset());
                }
                Piece::Headers => {
                    if let Some(headers) = m.headers() {
                        for (i, h) in headers.iter().enumerate() {
                            if i > 0 {
                                out.push(b',');
                            }
                            out.extend_from_slice(h.key.as_bytes());
                            out.push(b'=');
                            out.extend_from_slice(h.value.unwrap_or_default());
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod test {
    use rdkafka::Timestamp;
    use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};

    use super::*;

    fn message() -> OwnedMessage {
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "a",
                value: Some("1"),
            })
            .insert(Header {
                key: "b",
                value: None::<&[u8]>,
            });
        OwnedMessage::new(
            Some(b"v".to_vec()),
            Some(b"k".to_vec()),
            "t".into(),
            Timestamp::NotAvailable,
            3,
            42,
            Some(headers),
        )
    }

    fn render(format: &str) -> Result<String, String> {
        let f: Format = format.parse()?;
        let mut out = Vec::new();
        f.render(&message(), &mut out);
        String::from_utf8(out).map_err(|e| e.to_string())
    }

    #[test]
    fn renders_every_field_and_escape() -> Result<(), String> {
        assert_eq!(render("%s\\n")?, "v\n");
        assert_eq!(
            render("%t[%p]@%o\\t%k=%s %h 100%%\\\\")?,
            "t[3]@42\tk=v a=1,b= 100%\\"
        );
        assert_eq!(render("plain é")?, "plain é");
        Ok(())
    }

    #[test]
    fn refuses_unknown_fields_and_dangling_marks() {
        for bad in ["%x", "%", "a\\", "\\q"] {
            assert!(bad.parse::<Format>().is_err(), "{bad:?} was accepted");
        }
    }
}
