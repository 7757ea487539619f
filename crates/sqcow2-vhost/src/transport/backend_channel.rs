//! The backend's channel to the frontend, for the messages the backend
//! starts: here only `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG` (the config
//! space changed: a live resize), which QEMU's `vhost-user-blk` answers by
//! reading the config again and interrupting the guest.
//!
//! The frontend hands the channel over with `VHOST_USER_SET_BACKEND_REQ_FD`.
//! The vhost crate (0.18) receives it into a `Backend` that cannot send
//! this message, so the connection's reader takes that one request
//! itself, before the crate sees it ([`take_channel`]), and keeps the
//! socket here.

use std::io::{self, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendFlags, SocketType};
use vhost::vhost_user::message::VhostUserProtocolFeatures;

/// `VHOST_USER_SET_BACKEND_REQ_FD`.
const SET_BACKEND_REQ_FD: u32 = 21;
/// `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG`.
const CONFIG_CHANGE_MSG: u32 = 2;
/// A message header: request, flags, payload size (little-endian u32s).
const HEADER: usize = 12;
/// Header flags: protocol version 1; a reply; a reply is asked for.
const VERSION: u32 = 0x1;
const REPLY: u32 = 0x4;
const NEED_REPLY: u32 = 0x8;

/// The frontend's channel for messages the backend starts, once it gave
/// one; shared by the connection's reader and whoever tells the frontend
/// of a change.
#[derive(Debug, Clone, Default)]
pub(crate) struct BackendChannel {
    stream: Arc<Mutex<Option<UnixStream>>>,
    /// The protocol features the session negotiated (the connection's
    /// handler records them, see [`BackendChannel::negotiated`]).
    protocol: Arc<AtomicU64>,
}

impl BackendChannel {
    /// Where the connection's handler records the protocol features the
    /// frontend acked: the channel is taken only with `BACKEND_REQ`, and
    /// acked only with `REPLY_ACK`.
    pub(crate) fn negotiated(&self) -> Arc<AtomicU64> {
        self.protocol.clone()
    }

    fn has(&self, f: VhostUserProtocolFeatures) -> bool {
        self.protocol.load(Ordering::Relaxed) & f.bits() != 0
    }

    /// Tells the frontend that the config space changed (the message has
    /// no payload); whether it went out on a channel the frontend gave.
    /// Never waits: a frontend that does not read its channel is not told
    /// (`Ok(false)`).
    pub(crate) fn config_changed(&self) -> io::Result<bool> {
        // A descriptor of its own, so that no lock is held while sending.
        let stream = match self
            .stream
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            Some(s) => s.try_clone()?,
            None => return Ok(false),
        };
        let m = message(CONFIG_CHANGE_MSG, VERSION, &[]);
        match rustix::net::send(&stream, &m, SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
            Ok(n) if n == m.len() => Ok(true),
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "the frontend's channel took part of the message",
            )),
            Err(rustix::io::Errno::AGAIN) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn set(&self, stream: UnixStream) {
        *self.stream.lock().unwrap_or_else(PoisonError::into_inner) = Some(stream);
    }
}

/// A message: header, then `payload`.
fn message(request: u32, flags: u32, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(HEADER + payload.len());
    m.extend_from_slice(&request.to_le_bytes());
    m.extend_from_slice(&flags.to_le_bytes());
    m.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    m.extend_from_slice(payload);
    m
}

/// The next message's header on `conn`, left unread: waits until it is
/// all there; `None` at the end of the connection.
fn peek_header(conn: &UnixStream) -> io::Result<Option<[u8; HEADER]>> {
    let mut header = [0u8; HEADER];
    loop {
        // A peek returns what is queued (WAITALL does not make it wait
        // across packets): a header sent in pieces is waited for.
        match rustix::net::recv(conn, &mut header, RecvFlags::PEEK | RecvFlags::WAITALL)?.0 {
            0 => return Ok(None),
            HEADER => return Ok(Some(header)),
            _ => std::thread::sleep(std::time::Duration::from_millis(1)),
        }
    }
}

/// If the next message on `conn` (the frontend's connection, read by no
/// one else meanwhile) is `SET_BACKEND_REQ_FD`, receives it and its
/// socket into `channel`, answering it when the frontend asks (REPLY_ACK);
/// whether it did. Anything else is left unread for the vhost crate,
/// which also reports a connection that ended or a malformed message,
/// and refuses the request itself before `BACKEND_REQ` was negotiated.
pub(crate) fn take_channel(conn: &UnixStream, channel: &BackendChannel) -> io::Result<bool> {
    if !channel.has(VhostUserProtocolFeatures::BACKEND_REQ) {
        return Ok(false);
    }
    let Some(header) = peek_header(conn)? else {
        return Ok(false);
    };
    // QEMU (and the vhost crate's frontend) send no payload; a u64 is
    // taken too.
    let payload = u32_at(&header, 8) as usize;
    if u32_at(&header, 0) != SET_BACKEND_REQ_FD || !matches!(payload, 0 | 8) {
        return Ok(false);
    }
    let mut message_bytes = [0u8; HEADER + 8];
    let body = &mut message_bytes[..HEADER + payload];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        conn,
        &mut [IoSliceMut::new(body)],
        &mut control,
        RecvFlags::WAITALL | RecvFlags::CMSG_CLOEXEC,
    )?;
    // The descriptor ends what one receive returns: the rest may follow.
    if got.bytes < body.len() {
        let mut rest = conn;
        rest.read_exact(&mut body[got.bytes..])?;
    }
    let mut socket = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            // Every descriptor received is owned (and closed) here; the
            // first is the channel.
            for fd in fds {
                socket.get_or_insert(fd);
            }
        }
    }
    // Only a stream socket is a channel (as the vhost crate checks).
    let socket =
        socket.filter(|fd| rustix::net::sockopt::socket_type(fd).ok() == Some(SocketType::STREAM));
    let ok = match socket {
        Some(fd) => {
            channel.set(UnixStream::from(fd));
            tracing::debug!("the frontend gave its backend channel");
            0u64
        }
        None => {
            tracing::warn!("SET_BACKEND_REQ_FD without a stream socket");
            1
        }
    };
    if u32_at(body, 4) & NEED_REPLY != 0 && channel.has(VhostUserProtocolFeatures::REPLY_ACK) {
        let mut writer = conn;
        writer.write_all(&message(
            SET_BACKEND_REQ_FD,
            VERSION | REPLY,
            &ok.to_le_bytes(),
        ))?;
    }
    Ok(true)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsFd;

    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

    use super::*;

    /// The frontend's side: SET_BACKEND_REQ_FD with `flags` and
    /// `payload` (QEMU sends none), carrying one end of a new socket
    /// pair; the other end.
    fn send_channel(frontend: &UnixStream, flags: u32, payload: &[u8]) -> UnixStream {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let msg = message(SET_BACKEND_REQ_FD, flags, payload);
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds = [theirs.as_fd()];
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        rustix::net::sendmsg(
            frontend,
            &[std::io::IoSlice::new(&msg)],
            &mut control,
            SendFlags::empty(),
        )
        .unwrap();
        ours
    }

    /// A channel whose session negotiated `BACKEND_REQ` and `REPLY_ACK`.
    fn negotiated() -> BackendChannel {
        let channel = BackendChannel::default();
        channel.negotiated().store(
            (VhostUserProtocolFeatures::BACKEND_REQ | VhostUserProtocolFeatures::REPLY_ACK).bits(),
            std::sync::atomic::Ordering::Relaxed,
        );
        channel
    }

    /// As the protocol says: the channel is the backend's only once
    /// `BACKEND_REQ` was negotiated (before, the request is left for the
    /// crate to refuse), and an ack goes back only once `REPLY_ACK` was.
    #[test]
    fn the_channel_and_its_ack_follow_the_negotiated_features() {
        let (frontend, backend) = UnixStream::pair().unwrap();
        let channel = BackendChannel::default();
        let _ours = send_channel(&frontend, VERSION | NEED_REPLY, &[]);
        assert!(
            !take_channel(&backend, &channel).unwrap(),
            "taken without BACKEND_REQ negotiated"
        );
        let mut still = [0u8; HEADER];
        (&backend).read_exact(&mut still).unwrap();
        assert_eq!(u32_at(&still, 0), SET_BACKEND_REQ_FD);
        // BACKEND_REQ without REPLY_ACK: taken, no reply.
        let (frontend, backend) = UnixStream::pair().unwrap();
        channel.negotiated().store(
            VhostUserProtocolFeatures::BACKEND_REQ.bits(),
            std::sync::atomic::Ordering::Relaxed,
        );
        let _ours = send_channel(&frontend, VERSION | NEED_REPLY, &[]);
        assert!(take_channel(&backend, &channel).unwrap());
        frontend.set_nonblocking(true).unwrap();
        let mut reply = [0u8; 1];
        let got = (&frontend).read(&mut reply);
        assert!(
            matches!(&got, Err(e) if e.kind() == io::ErrorKind::WouldBlock),
            "a reply without REPLY_ACK: {got:?}"
        );
    }

    #[test]
    fn the_channel_is_taken_acked_and_carries_the_config_change() {
        let (frontend, backend) = UnixStream::pair().unwrap();
        let channel = negotiated();
        assert!(!channel.config_changed().unwrap(), "no channel yet");
        // As QEMU sends it: no payload, a reply asked for.
        let mut ours = send_channel(&frontend, VERSION | NEED_REPLY, &[]);
        assert!(take_channel(&backend, &channel).unwrap());
        // The ack: a reply to request 21, success.
        let mut ack = [0u8; HEADER + 8];
        (&frontend).read_exact(&mut ack).unwrap();
        assert_eq!(u32_at(&ack, 0), SET_BACKEND_REQ_FD);
        assert_eq!(u32_at(&ack, 4), VERSION | REPLY);
        assert_eq!(&ack[HEADER..], &0u64.to_le_bytes());
        // The config change arrives on the channel the frontend gave.
        assert!(channel.config_changed().unwrap());
        let mut m = [0u8; HEADER];
        ours.read_exact(&mut m).unwrap();
        assert_eq!(u32_at(&m, 0), CONFIG_CHANGE_MSG);
        assert_eq!(u32_at(&m, 8), 0, "the message has no payload");
    }

    #[test]
    fn other_messages_are_left_for_the_crate() {
        let (frontend, backend) = UnixStream::pair().unwrap();
        let channel = negotiated();
        // GET_FEATURES (1), no payload.
        (&frontend).write_all(&message(1, VERSION, &[])).unwrap();
        assert!(!take_channel(&backend, &channel).unwrap());
        let mut still = [0u8; HEADER];
        (&backend).read_exact(&mut still).unwrap();
        assert_eq!(u32_at(&still, 0), 1, "the message is still there");
        // Without NEED_REPLY the channel is taken silently.
        let _ours = send_channel(&frontend, VERSION, &0u64.to_le_bytes());
        assert!(take_channel(&backend, &channel).unwrap());
        drop(frontend);
        // The connection's end is the crate's to report.
        assert!(!take_channel(&backend, &channel).unwrap());
    }

    /// A frontend that never reads its channel: telling it does not wait
    /// (the control thread, and a second SET_BACKEND_REQ_FD, go on).
    #[test]
    fn a_channel_nobody_reads_does_not_block() {
        let (frontend, backend) = UnixStream::pair().unwrap();
        let channel = negotiated();
        let _ours = send_channel(&frontend, VERSION, &[]);
        assert!(take_channel(&backend, &channel).unwrap());
        let mut told = 0;
        while channel.config_changed().unwrap() {
            told += 1;
            assert!(told < 1_000_000, "the channel never filled");
        }
        // Another channel replaces it at once.
        let _again = send_channel(&frontend, VERSION, &[]);
        assert!(take_channel(&backend, &channel).unwrap());
    }

    /// A header that arrives in pieces, and a body after the descriptor.
    #[test]
    fn a_request_in_pieces_is_taken_whole() {
        let (frontend, backend) = UnixStream::pair().unwrap();
        let channel = negotiated();
        let msg = message(SET_BACKEND_REQ_FD, VERSION, &7u64.to_le_bytes());
        let (_ours, theirs) = UnixStream::pair().unwrap();
        let writer = {
            let frontend = frontend.try_clone().unwrap();
            std::thread::spawn(move || {
                (&frontend).write_all(&msg[..4]).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(50));
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                let fds = [theirs.as_fd()];
                assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
                rustix::net::sendmsg(
                    &frontend,
                    &[std::io::IoSlice::new(&msg[4..HEADER])],
                    &mut control,
                    SendFlags::empty(),
                )
                .unwrap();
                std::thread::sleep(std::time::Duration::from_millis(50));
                (&frontend).write_all(&msg[HEADER..]).unwrap();
            })
        };
        assert!(take_channel(&backend, &channel).unwrap());
        writer.join().unwrap();
        // Nothing of it is left for the crate: the next message is next.
        (&frontend).write_all(&message(1, VERSION, &[])).unwrap();
        let mut next = [0u8; HEADER];
        (&backend).read_exact(&mut next).unwrap();
        assert_eq!(u32_at(&next, 0), 1);
        assert!(channel.config_changed().unwrap());
    }
}
