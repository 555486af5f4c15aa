//! One attached client's byte stream, after `vm.console` switched its connection over: the
//! replay, then the guest's output as it comes; the client's bytes go to the guest when it is
//! the writer and are read and dropped otherwise (a watcher's keystrokes never reach the guest).
//!
//! Output and input run side by side, so a client that does not read its output can still
//! detach, and one that does not type still gets its output. A client whose socket takes no
//! output for [`WRITE_TIMEOUT`] is dropped; one that is merely slow loses
//! the chunks the hub could not keep for it, and is told how many bytes
//! ([`super::ring::dropped_marker`]). Why the session ends is written to the client as a last
//! line (`[vmhost: ...]`) where the socket still takes it.

use super::hub::Attachment;
use super::ring::{dropped, dropped_marker};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{broadcast, watch};

/// How long one write to the client may wait before the client is dropped. Longer than the
/// JSON-RPC peers' 30 s: a client that does not read costs the daemon nothing here but its
/// connection (the output it misses is not kept for it), and an operator's terminal may pause.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(300);

/// How long the last line (why the session ends) may take.
const LAST_WORD: Duration = Duration::from_secs(1);

/// Largest read of the client's input.
const INPUT_CHUNK: usize = 4096;

/// Why a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// The client closed its side (detached).
    Detached,
    /// The client's socket failed or took nothing for [`WRITE_TIMEOUT`].
    ClientGone,
    /// A forced writer took over; the text tells the client so.
    TakenOver(String),
    /// The VM's QEMU closed the console (it stopped).
    ConsoleClosed,
    /// The daemon is stopping.
    Shutdown,
}

impl Ending {
    /// What the client is told, if anything.
    fn last_word(&self) -> Option<String> {
        match self {
            Ending::Detached | Ending::ClientGone => None,
            Ending::TakenOver(text) => Some(text.clone()),
            Ending::ConsoleClosed => Some("\r\n[vmhost: console closed: the VM's QEMU ended]\r\n".into()),
            Ending::Shutdown => Some("\r\n[vmhost: vmhostd is stopping; console detached]\r\n".into()),
        }
    }
}

/// Runs the stream of one attached client until it ends; `early_input` is what the client
/// sent after its request line, before the switch. Detaches the client when it returns.
pub async fn run(
    stream: UnixStream,
    attachment: Attachment,
    early_input: Vec<u8>,
    mut shutdown: watch::Receiver<bool>,
) -> Ending {
    let Attachment { replay, next, output, kicked, member } = attachment;
    let (mut rd, mut wr) = stream.into_split();
    let ending = {
        let out = pump_output(&mut wr, replay, next, output);
        let input = async {
            if !early_input.is_empty() {
                member.send_input(early_input).await;
            }
            let mut buf = vec![0u8; INPUT_CHUNK];
            loop {
                match rd.read(&mut buf).await {
                    Ok(0) => return Ending::Detached,
                    Err(_) => return Ending::ClientGone,
                    // A watcher's (or replaced writer's) bytes are read and dropped here.
                    Ok(n) => {
                        member.send_input(buf[..n].to_vec()).await;
                    }
                }
            }
        };
        let taken_over = async {
            match kicked {
                Some(rx) => match rx.await {
                    Ok(text) => text,
                    Err(_) => std::future::pending().await,
                },
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ending = out => ending,
            ending = input => ending,
            text = taken_over => Ending::TakenOver(text),
            _ = shutdown.wait_for(|s| *s) => Ending::Shutdown,
        }
    };
    // Detach before the last word: a taken-over writer is no writer any more either way.
    drop(member);
    if let Some(text) = ending.last_word() {
        let _ = tokio::time::timeout(LAST_WORD, wr.write_all(text.as_bytes())).await;
    }
    let _ = wr.shutdown().await;
    ending
}

/// Writes the replay, then every chunk of output, saying how much was lost where the client
/// fell behind; returns when the console closes or the client stops taking output.
async fn pump_output(
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    replay: Vec<u8>,
    mut expected: u64,
    mut output: broadcast::Receiver<super::hub::Chunk>,
) -> Ending {
    if !write(wr, &replay).await {
        return Ending::ClientGone;
    }
    drop(replay);
    loop {
        let chunk = match output.recv().await {
            Ok(chunk) => chunk,
            // The next chunk received says how many bytes were lost.
            Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => return Ending::ConsoleClosed,
        };
        let lost = dropped(expected, chunk.start);
        if lost > 0 && !write(wr, dropped_marker(lost).as_bytes()).await {
            return Ending::ClientGone;
        }
        if !write(wr, &chunk.bytes).await {
            return Ending::ClientGone;
        }
        expected = chunk.start + chunk.bytes.len() as u64;
    }
}

/// Writes all of `bytes` within [`WRITE_TIMEOUT`]; false when the client is gone or stuck.
async fn write(wr: &mut tokio::net::unix::OwnedWriteHalf, bytes: &[u8]) -> bool {
    matches!(tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(bytes)).await, Ok(Ok(())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::console::hub::{Hub, Mode, Peer};

    /// The bytes each dropped marker in `text` says were lost.
    fn lost(text: &str) -> u64 {
        text.split("[vmhost: ").skip(1).filter_map(|m| m.split(' ').next()?.parse::<u64>().ok()).sum()
    }

    #[tokio::test]
    async fn a_client_that_fell_behind_is_told_how_much_it_lost_then_why_it_ends() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("con");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let hub = Hub::connect("vm", &path, &d.path().join("none.log")).await.unwrap();
        let (mut guest, _) = listener.accept().await.unwrap();
        let attachment = hub.join(Mode::Watch { limited: false }, Peer { uid: 0, pid: 1 }).unwrap();
        let (daemon_side, mut client) = UnixStream::pair().unwrap();
        let (_stop, shutdown) = watch::channel(false);
        let session = tokio::spawn(run(daemon_side, attachment, Vec::new(), shutdown));
        // The guest prints far more than every buffer while the client reads nothing; then its
        // QEMU goes away.
        let total = 4 * 1024 * 1024;
        guest.write_all(&vec![b'x'; total]).await.unwrap();
        drop(guest);
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        let text = String::from_utf8_lossy(&got);
        let shown = got.iter().filter(|b| **b == b'x').count() as u64;
        assert!(shown < total as u64, "nothing was dropped: the test did not fill the buffers");
        assert_eq!(shown + lost(&text), total as u64, "every byte is shown or counted as lost");
        assert!(text.ends_with("[vmhost: console closed: the VM's QEMU ended]\r\n"), "{}", &text[text.len() - 80..]);
        assert_eq!(session.await.unwrap(), Ending::ConsoleClosed);
    }
}
