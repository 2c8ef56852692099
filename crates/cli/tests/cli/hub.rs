//! `--model ORG/NAME`: Hub models downloaded into the Hugging Face cache
//! from a small server on 127.0.0.1 that answers as the Hub's file API
//! does (`HF_ENDPOINT` points at it), then read from the cache with the
//! server gone, `HF_HUB_OFFLINE=1`, errors, and a download cut short that
//! resumes.

use crate::common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::{bin, one_line_error};

/// The commit every served repository is at.
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A repository: its files by name.
type Files = HashMap<String, Vec<u8>>;

/// The Hub's file API for a few repositories, as `huggingface_hub` and
/// the `hf-hub` crate use it: `GET /api/models/ORG/NAME/revision/REV`
/// lists the files (`siblings`); `GET /ORG/NAME/resolve/REV/FILE` with a
/// `Range` answers 206 with `Content-Range`, `ETag` and `X-Repo-Commit`.
struct HubServer {
    endpoint: String,
    /// "PATH RANGE" of every request, in order.
    log: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HubServer {
    /// Serves `repos`; with `cut`, the first whole-file request for that
    /// file sends only that many bytes of it and drops the connection.
    fn start(repos: Vec<(&str, Files)>, cut: Option<(&str, usize)>) -> HubServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let repos: HashMap<String, Files> =
            repos.into_iter().map(|(r, f)| (r.to_string(), f)).collect();
        let log = Arc::new(Mutex::new(vec![]));
        let stop = Arc::new(AtomicBool::new(false));
        let mut cut = cut.map(|(f, n)| (f.to_string(), n));
        let thread = {
            let (log, stop) = (log.clone(), stop.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    if let Ok(s) = stream {
                        let _ = answer(s, &repos, &log, &mut cut);
                    }
                }
            })
        };
        HubServer {
            endpoint,
            log,
            stop,
            thread: Some(thread),
        }
    }

    fn requests(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Stops serving: later connections are refused.
    fn shut_down(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.endpoint.trim_start_matches("http://"));
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for HubServer {
    fn drop(&mut self) {
        self.shut_down();
    }
}

fn answer(
    mut s: TcpStream,
    repos: &HashMap<String, Files>,
    log: &Mutex<Vec<String>>,
    cut: &mut Option<(String, usize)>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(s.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut range = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("range") {
                range = Some(v.trim().to_string());
            }
        }
    }
    log.lock()
        .unwrap()
        .push(format!("{path} {}", range.as_deref().unwrap_or("-")));
    let respond = |s: &mut TcpStream, status: &str, headers: &[(String, String)], body: &[u8]| {
        let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        s.write_all(head.as_bytes())?;
        s.write_all(body)
    };
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    // /api/models/ORG/NAME/revision/REV
    if parts.len() == 6 && parts[0] == "api" && parts[1] == "models" && parts[4] == "revision" {
        let repo = format!("{}/{}", parts[2], parts[3]);
        return match repos.get(&repo) {
            Some(files) => {
                let siblings: Vec<_> = files
                    .keys()
                    .map(|f| serde_json::json!({ "rfilename": f }))
                    .collect();
                let body = serde_json::json!({"id": repo, "sha": COMMIT, "siblings": siblings});
                let json = ("Content-Type".to_string(), "application/json".to_string());
                respond(&mut s, "200 OK", &[json], body.to_string().as_bytes())
            }
            None => respond(
                &mut s,
                "404 Not Found",
                &[("X-Error-Code".into(), "RepositoryNotFound".into())],
                b"{\"error\":\"Repository not found\"}",
            ),
        };
    }
    // /ORG/NAME/resolve/REV/FILE
    let file = (parts.len() >= 5 && parts[2] == "resolve")
        .then(|| repos.get(&format!("{}/{}", parts[0], parts[1])))
        .flatten()
        .and_then(|files| {
            files
                .get(&parts[4..].join("/"))
                .map(|b| (parts[4..].join("/"), b))
        });
    let Some((name, bytes)) = file else {
        return respond(
            &mut s,
            "404 Not Found",
            &[("X-Error-Code".into(), "EntryNotFound".into())],
            b"Entry not found",
        );
    };
    let total = bytes.len();
    let (start, end) = match range.as_deref().and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) => {
            let (a, b) = r.split_once('-').unwrap();
            let a: usize = a.parse().unwrap();
            let b = if b.is_empty() {
                total - 1
            } else {
                b.parse::<usize>().unwrap()
            };
            (a, b.min(total - 1))
        }
        None => (0, total - 1),
    };
    let headers = vec![
        ("ETag".to_string(), format!("\"{}\"", content_tag(bytes))),
        ("X-Repo-Commit".to_string(), COMMIT.to_string()),
        (
            "Content-Range".to_string(),
            format!("bytes {start}-{end}/{total}"),
        ),
    ];
    let body = &bytes[start..=end];
    if let Some((f, n)) = cut.clone() {
        if f == name && start == 0 && end == total - 1 {
            // Announce the whole body, send part of it, hang up.
            *cut = None;
            let mut head = "HTTP/1.1 206 Partial Content\r\nConnection: close\r\n".to_string();
            for (k, v) in &headers {
                head.push_str(&format!("{k}: {v}\r\n"));
            }
            head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
            s.write_all(head.as_bytes())?;
            s.write_all(&body[..n])?;
            s.flush()?;
            return s.shutdown(std::net::Shutdown::Both);
        }
    }
    respond(&mut s, "206 Partial Content", &headers, body)
}

/// A stand-in for the Hub's ETag (the blob's name in the cache): a
/// 64-hex-digit digest of the content (FNV-1a, four lanes).
fn content_tag(bytes: &[u8]) -> String {
    (0..4u64)
        .map(|lane| {
            let mut h = 0xcbf29ce484222325u64 ^ lane;
            for &b in bytes {
                h = (h ^ b as u64).wrapping_mul(0x100000001b3);
            }
            format!("{h:016x}")
        })
        .collect()
}

/// The files of a model directory.
fn files_of(dir: &Path) -> Files {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

fn chat_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/chat/model")
}

fn chat_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/chat/data/chat")
}

/// The binary with the Hugging Face environment of a test: its own
/// `HF_HOME`, the server as `HF_ENDPOINT`, no token, online.
fn hub_bin(hf_home: &Path, endpoint: &str) -> Command {
    let mut c = bin();
    c.env("HF_HOME", hf_home)
        .env("HF_ENDPOINT", endpoint)
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN");
    c
}

fn ok(o: Output) -> (String, String) {
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "stderr: {err}");
    (out, err)
}

/// The acceptance path: from an empty `HF_HOME`, a LoRA run on a Hub
/// model downloads it (one line per file), trains, and a chat with the
/// adapter stops at the model's end of turn; with the server gone the same
/// commands run from the cache; offline, an uncached model fails in one line.
#[test]
fn a_hub_model_downloads_trains_chats_and_then_runs_from_the_cache() {
    let t = common::tmp();
    let hf = t.path().join("hf");
    let mut server = HubServer::start(vec![("test-org/chat-tiny", files_of(&chat_model()))], None);
    let run = t.path().join("run");
    // 80 steps: this 2-layer model of width 64 needs them to learn the
    // replies' form (the end of turn included).
    let train = |endpoint: &str, out: &Path, steps: &str| {
        hub_bin(&hf, endpoint)
            .args(["train", "--model", "test-org/chat-tiny", "--data"])
            .arg(chat_data())
            .args([
                "--lora-rank",
                "8",
                "--mask-prompt",
                "--steps",
                steps,
                "--batch",
                "8",
            ])
            .args([
                "--seq",
                "128",
                "--lr",
                "1e-2",
                "--eval-every",
                "0",
                "--backend",
                "cpu",
            ])
            .arg("--out")
            .arg(out)
            .output()
            .unwrap()
    };
    let (_, err) = ok(train(&server.endpoint, &run, "80"));
    // The adapter names its base by the Hub id, as PEFT does, not by the
    // snapshot directory of this machine's cache; so does the hint.
    let adapter: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(adapter["base_model_name_or_path"], "test-org/chat-tiny");
    assert!(adapter["revision"].is_null(), "{adapter}");
    assert!(
        err.contains("anetrain generate --model test-org/chat-tiny --adapter"),
        "{err}"
    );
    assert!(
        err.contains("training test-org/chat-tiny (") && !err.contains("snapshots/"),
        "the run names the model by its id: {err}"
    );
    let refused = hub_bin(&hf, &server.endpoint)
        .args(["train", "--model", "test-org/chat-tiny", "--data"])
        .arg(chat_data())
        .args(["--lora-rank", "8", "--max-memory", "1M", "--backend", "cpu"])
        .arg("--out")
        .arg(t.path().join("refused"))
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&refused.stderr);
    assert!(
        e.contains("`anetrain kernels plan --model test-org/chat-tiny --seq"),
        "the refusal's hint names the id: {e}"
    );
    for f in [
        "config.json",
        "tokenizer.json",
        "generation_config.json",
        "model.safetensors",
    ] {
        assert!(
            err.contains(&format!("downloading test-org/chat-tiny: {f}")),
            "{f}: {err}"
        );
    }
    // The cache as huggingface_hub lays it out: the ref names the commit,
    // the snapshot's files are relative links to content-named blobs.
    let repo = hf.join("hub/models--test-org--chat-tiny");
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main")).unwrap(),
        COMMIT
    );
    let config = repo.join("snapshots").join(COMMIT).join("config.json");
    let link = std::fs::read_link(&config).unwrap();
    assert!(
        link.is_relative() && link.starts_with("../../blobs"),
        "{link:?}"
    );
    assert_eq!(
        std::fs::read(&config).unwrap(),
        std::fs::read(chat_model().join("config.json")).unwrap()
    );

    let chat = |endpoint: &str, extra: &[(&str, &str)]| {
        let mut c = hub_bin(&hf, endpoint);
        c.args(["generate", "--model", "test-org/chat-tiny", "--adapter"])
            .arg(&run)
            .args([
                "--chat",
                "--prompt",
                "What is 3 plus 4?",
                "--temperature",
                "0",
            ])
            .args(["--max-tokens", "200", "--backend", "cpu"]);
        for (k, v) in extra {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    // A reply in the records' form ("3 plus 4 is 7."), ended by the
    // end-of-turn token long before the 200-token limit.
    let (reply, _) = ok(chat(&server.endpoint, &[]));
    assert!(
        reply.contains(" plus ") && reply.contains(" is "),
        "{reply:?}"
    );
    assert!(
        reply.len() < 60 && !reply.contains("<|im_end|>"),
        "{reply:?}"
    );
    server.shut_down();

    // The server is gone: the cache serves the same commands.
    let (again, err) = ok(chat(&server.endpoint, &[]));
    assert_eq!(again, reply);
    assert!(!err.contains("downloading"), "{err}");
    let (_, err) = ok(train(&server.endpoint, &t.path().join("run2"), "2"));
    assert!(!err.contains("downloading"), "{err}");

    // Offline with a model never downloaded: one line naming it and the cache.
    let o = hub_bin(&hf, &server.endpoint)
        .env("HF_HUB_OFFLINE", "1")
        .args([
            "generate",
            "--model",
            "test-org/never-seen",
            "--prompt",
            "Hi",
        ])
        .output()
        .unwrap();
    one_line_error(
        &o,
        "offline",
        &[
            "test-org/never-seen",
            "HF_HUB_OFFLINE",
            "models--test-org--never-seen",
        ],
    );
    // Offline with the cached one: fine.
    ok(chat(&server.endpoint, &[("HF_HUB_OFFLINE", "1")]));
}

/// A repository that does not exist, one without safetensors, a shard its
/// index names but the server lacks, and no server at all: one line each.
#[test]
fn hub_failures_are_one_line_errors() {
    let t = common::tmp();
    let hf = t.path().join("hf");
    let mut no_weights = files_of(&chat_model());
    no_weights.remove("model.safetensors");
    let mut lost_shard = no_weights.clone();
    lost_shard.insert(
        "model.safetensors.index.json".into(),
        br#"{"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}"#.to_vec(),
    );
    let mut server = HubServer::start(
        vec![
            ("test-org/no-weights", no_weights),
            ("test-org/lost-shard", lost_shard),
        ],
        None,
    );
    let generate = |model: &str, endpoint: &str| {
        hub_bin(&hf, endpoint)
            .args([
                "generate",
                "--model",
                model,
                "--prompt",
                "Hi",
                "--backend",
                "cpu",
            ])
            .output()
            .unwrap()
    };
    one_line_error(
        &generate("test-org/missing", &server.endpoint),
        "404",
        &["'test-org/missing' is not a model repository", "404"],
    );
    one_line_error(
        &generate("test-org/no-weights", &server.endpoint),
        "no weights",
        &["test-org/no-weights", "no safetensors weights"],
    );
    // The files before the lost one are reported as they arrive.
    let o = generate("test-org/lost-shard", &server.endpoint);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert_eq!(e.matches("error:").count(), 1, "{e}");
    assert!(
        e.trim_end()
            .lines()
            .last()
            .unwrap()
            .starts_with("error: 'test-org/lost-shard' has no model-00001-of-00002.safetensors"),
        "{e}"
    );
    let endpoint = server.endpoint.clone();
    server.shut_down();
    one_line_error(
        &generate("test-org/missing", &endpoint),
        "no server",
        &[
            "test-org/missing",
            "cannot be reached",
            "models--test-org--missing",
        ],
    );
    // Partly cached (the download stopped at the lost shard): what the
    // snapshot lacks, not "not in the cache".
    one_line_error(
        &generate("test-org/lost-shard", &endpoint),
        "partly cached, no server",
        &[
            "'test-org/lost-shard': its cached snapshot lacks model-00001-of-00002.safetensors",
            "cannot be reached",
        ],
    );
}

/// A connection dropped in the middle of the weights: the download picks
/// up from the bytes it has (a `Range` request from there), and the blob
/// is the file.
#[test]
fn an_interrupted_download_resumes() {
    let t = common::tmp();
    let hf = t.path().join("hf");
    let files = files_of(&chat_model());
    let weights = files["model.safetensors"].clone();
    let cut = 100_000;
    assert!(weights.len() > 2 * cut);
    let server = HubServer::start(
        vec![("test-org/chat-tiny", files)],
        Some(("model.safetensors", cut)),
    );
    ok(hub_bin(&hf, &server.endpoint)
        .args(["eval", "--model", "test-org/chat-tiny", "--data"])
        .arg(chat_data().join("valid.jsonl"))
        .args(["--backend", "cpu"])
        .output()
        .unwrap());
    let log = server.requests();
    assert!(
        log.iter()
            .any(|r| r.contains("model.safetensors bytes=100000-")),
        "{log:#?}"
    );
    let snapshot = hf
        .join("hub/models--test-org--chat-tiny/snapshots")
        .join(COMMIT);
    assert_eq!(
        std::fs::read(snapshot.join("model.safetensors")).unwrap(),
        weights
    );
}

/// A local directory of the same name wins: the server is never asked.
#[test]
fn a_local_directory_wins_over_a_hub_id() {
    let t = common::tmp();
    let local = t.path().join("test-org/chat-tiny");
    std::fs::create_dir_all(&local).unwrap();
    for (name, bytes) in files_of(&chat_model()) {
        std::fs::write(local.join(name), bytes).unwrap();
    }
    let server = HubServer::start(vec![], None);
    ok(hub_bin(&t.path().join("hf"), &server.endpoint)
        .current_dir(t.path())
        .args([
            "generate",
            "--model",
            "test-org/chat-tiny",
            "--prompt",
            "Hi",
        ])
        .args(["--max-tokens", "2", "--backend", "cpu"])
        .output()
        .unwrap());
    assert!(server.requests().is_empty(), "{:?}", server.requests());
}
