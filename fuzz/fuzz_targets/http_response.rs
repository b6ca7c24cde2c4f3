//! Replies of an HTTP metadata server as `HttpStore` reads them (status line, headers, a body
//! of `Content-Length` bytes or up to the end): `tern_metadata::http::parse_response`.
//! Properties: a reply is accepted only after a status line (`HTTP/…` and a code), the body
//! is at most 32 MiB and is the bytes just before where parsing stopped, and a reply
//! written the way the embedded server writes it parses back to the same status and body.
#![cfg_attr(fuzzing, no_main)]

use tern_metadata::http::parse_response;

tern_fuzz::target!(|data| {
    let mut reader = data;
    let Ok((status, body)) = parse_response(&mut reader) else {
        return;
    };
    assert!(
        data.starts_with(b"HTTP/"),
        "no status line, yet status {status}"
    );
    assert!(body.len() <= 32 << 20);
    let consumed = data.len() - reader.len();
    assert_eq!(&data[consumed - body.len()..consumed], &body[..]);
    let mut again = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    again.extend_from_slice(&body);
    let reparsed = parse_response(&mut &again[..]).expect("a reply as the server writes it");
    assert_eq!(reparsed, (status, body));
});
