// The app of the services overhead benchmark (scripts/bench-services.sh; issue 15, FreeNA's Tables 4 and 5): a
// client that sends N writes of SIZE bytes of text and a server that reads them, either plain (flexstack's
// services do the work) or doing the same work itself: zstd in flexstack's `compress` framing (docs/services.md:
// blocks with a 4-byte big-endian header, bit 31 = stored, bits 0-30 = the payload's length), TLS (OpenSSL), or
// both (blocks inside TLS).
//
//   svc_app server PORT MODE [CERT KEY]          MODE: plain, zstd, tls, tls+zstd; serves one connection at a time
//   svc_app client ADDR PORT MODE N SIZE [CA]    prints "SECONDS BYTES": from connect to the server's answer
//
// The client sends N writes (each SIZE bytes of a 1 MiB text, in turn; in the zstd modes each write is one block,
// zstd level 3), then closes its side (TLS: close_notify first). The server counts the plaintext bytes it read
// and answers with that count (8 bytes; a stored block in the zstd modes, over TLS in the tls modes), which the
// client checks against N * SIZE. Build: cc -O2 -o svc_app svc_app.c -lzstd -lssl -lcrypto.
#include "bench.h"
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zstd.h>

#define MAX_BLOCK (64 * 1024)
#define MAX_PAYLOAD (MAX_BLOCK + 1024)
#define STORED 0x80000000u
#define TEXT (1 << 20)

static int use_tls, use_zstd;
static SSL *ssl;
static int fd;

static void die_ssl(const char *what) {
  fprintf(stderr, "%s: ", what);
  ERR_print_errors_fp(stderr);
  fprintf(stderr, "\n");
  exit(1);
}

static void put(const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = use_tls ? SSL_write(ssl, p, (int)len) : write(fd, p, len);
    if (n <= 0) use_tls ? die_ssl("SSL_write") : die("write");
    p += n;
    len -= (size_t)n;
  }
}

// Reads up to len bytes; 0 at the end of the stream.
static size_t get(void *buf, size_t len) {
  if (use_tls) {
    int n = SSL_read(ssl, buf, (int)len);
    if (n > 0) return (size_t)n;
    int e = SSL_get_error(ssl, n);
    if (e == SSL_ERROR_ZERO_RETURN || e == SSL_ERROR_SYSCALL) return 0;
    die_ssl("SSL_read");
  }
  ssize_t n = read(fd, buf, len);
  if (n < 0) die("read");
  return (size_t)n;
}

static void get_all(void *buf, size_t len) {
  char *p = buf;
  while (len > 0) {
    size_t n = get(p, len);
    if (n == 0) {
      fprintf(stderr, "svc_app: the stream ended early\n");
      exit(1);
    }
    p += n;
    len -= n;
  }
}

static void mode(const char *m) {
  if (!strcmp(m, "plain")) return;
  if (!strcmp(m, "zstd")) use_zstd = 1;
  else if (!strcmp(m, "tls")) use_tls = 1;
  else if (!strcmp(m, "tls+zstd")) use_tls = use_zstd = 1;
  else {
    fprintf(stderr, "svc_app: mode plain, zstd, tls or tls+zstd, not %s\n", m);
    exit(2);
  }
}

// One block of `len` bytes in `block` (header included); returns its length.
static size_t pack(ZSTD_CCtx *z, const char *in, size_t len, unsigned char *block) {
  size_t n = ZSTD_compressCCtx(z, block + 4, MAX_PAYLOAD, in, len, 3);
  uint32_t h;
  if (ZSTD_isError(n) || n >= len) {
    memcpy(block + 4, in, len);
    n = len;
    h = (uint32_t)n | STORED;
  } else {
    h = (uint32_t)n;
  }
  h = htonl(h);
  memcpy(block, &h, 4);
  return n + 4;
}

static void serve(int conn, SSL_CTX *ctx) {
  fd = conn;
  if (use_tls) {
    ssl = SSL_new(ctx);
    SSL_set_fd(ssl, fd);
    if (SSL_accept(ssl) != 1) {
      ERR_print_errors_fp(stderr);
      SSL_free(ssl);
      close(fd);
      return;
    }
  }
  static unsigned char buf[4 * MAX_PAYLOAD], out[MAX_BLOCK];
  ZSTD_DCtx *z = ZSTD_createDCtx();
  uint64_t plain = 0;
  size_t have = 0;
  for (;;) {
    size_t n = get(buf + have, sizeof buf - have);
    if (n == 0) break;
    if (!use_zstd) {
      plain += n;
      continue;
    }
    have += n;
    size_t at = 0;
    while (have - at >= 4) {
      uint32_t h;
      memcpy(&h, buf + at, 4);
      h = ntohl(h);
      size_t len = h & 0x3fffffffu;
      if (len > MAX_PAYLOAD) {
        fprintf(stderr, "svc_app: a block of %zu bytes\n", len);
        exit(1);
      }
      if (have - at - 4 < len) break;
      if (h & STORED) {
        plain += len;
      } else {
        size_t m = ZSTD_decompressDCtx(z, out, sizeof out, buf + at + 4, len);
        if (ZSTD_isError(m)) {
          fprintf(stderr, "svc_app: zstd: %s\n", ZSTD_getErrorName(m));
          exit(1);
        }
        plain += m;
      }
      at += 4 + len;
    }
    memmove(buf, buf + at, have - at);
    have -= at;
  }
  ZSTD_freeDCtx(z);
  unsigned char answer[12];
  uint32_t h = htonl(8 | STORED);
  memcpy(answer, &h, 4);
  memcpy(answer + 4, &plain, 8);
  if (use_zstd) put(answer, 12);
  else put(answer + 4, 8);
  if (use_tls) {
    SSL_shutdown(ssl);
    SSL_free(ssl);
  }
  shutdown(fd, SHUT_WR);
  while (read(fd, buf, sizeof buf) > 0) {
  }
  close(fd);
}

static int server(int argc, char **argv) {
  if (argc < 4) return 2;
  mode(argv[3]);
  SSL_CTX *ctx = NULL;
  if (use_tls) {
    if (argc < 6) return 2;
    ctx = SSL_CTX_new(TLS_server_method());
    if (SSL_CTX_use_certificate_chain_file(ctx, argv[4]) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx, argv[5], SSL_FILETYPE_PEM) != 1)
      die_ssl("certificate");
  }
  int s = socket(AF_INET6, SOCK_STREAM, 0), one = 1, zero = 0;
  if (s < 0) die("socket");
  setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
  struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)atoi(argv[2]))};
  if (bind(s, (struct sockaddr *)&a, sizeof a) < 0) die("bind");
  if (listen(s, 16) < 0) die("listen");
  for (;;) {
    int c = accept(s, NULL, NULL);
    if (c < 0) die("accept");
    serve(c, ctx);
  }
}

static int client(int argc, char **argv) {
  if (argc < 7) return 2;
  mode(argv[4]);
  long count = atol(argv[5]);
  size_t size = (size_t)atol(argv[6]);
  if (size == 0 || size > MAX_BLOCK) {
    fprintf(stderr, "svc_app: SIZE 1 to %d\n", MAX_BLOCK);
    return 2;
  }
  char *text = malloc(TEXT + MAX_BLOCK);
  size_t len = 0;
  for (long i = 0; len < TEXT + MAX_BLOCK; i++) {
    char line[96];
    int n = snprintf(line, sizeof line, "line %ld: value %lx the quick brown fox\n", i,
                     (unsigned long)((uint64_t)i * 0x9e3779b97f4a7c15ull >> 40));
    size_t take = (size_t)n < TEXT + MAX_BLOCK - len ? (size_t)n : TEXT + MAX_BLOCK - len;
    memcpy(text + len, line, take);
    len += take;
  }
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai;
  if (getaddrinfo(argv[2], argv[3], &hints, &ai) != 0) die("getaddrinfo");
  SSL_CTX *ctx = NULL;
  if (use_tls) {
    if (argc < 8) return 2;
    ctx = SSL_CTX_new(TLS_client_method());
    if (SSL_CTX_load_verify_locations(ctx, argv[7], NULL) != 1) die_ssl("CA");
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
  }
  double t0 = now_us();
  fd = socket(ai->ai_family, SOCK_STREAM, 0);
  if (fd < 0 || connect(fd, ai->ai_addr, ai->ai_addrlen) < 0) die("connect");
  if (use_tls) {
    ssl = SSL_new(ctx);
    SSL_set_fd(ssl, fd);
    X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), argv[2]);
    if (SSL_connect(ssl) != 1) die_ssl("SSL_connect");
  }
  ZSTD_CCtx *z = ZSTD_createCCtx();
  unsigned char *block = malloc(4 + MAX_PAYLOAD);
  size_t at = 0;
  for (long i = 0; i < count; i++) {
    const char *piece = text + at;
    at = (at + size) % TEXT;
    if (use_zstd) put(block, pack(z, piece, size, block));
    else put(piece, size);
  }
  if (use_tls) SSL_shutdown(ssl);
  shutdown(fd, SHUT_WR);
  unsigned char answer[12];
  uint64_t got;
  if (use_zstd) {
    get_all(answer, 12);
    memcpy(&got, answer + 4, 8);
  } else {
    get_all(answer, 8);
    memcpy(&got, answer, 8);
  }
  double secs = (now_us() - t0) / 1e6;
  if (got != (uint64_t)count * size) {
    fprintf(stderr, "svc_app: the server read %llu bytes, not %llu\n", (unsigned long long)got,
            (unsigned long long)count * size);
    return 1;
  }
  printf("%.6f %llu\n", secs, (unsigned long long)got);
  return 0;
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  int rc = 2;
  if (argc > 1 && !strcmp(argv[1], "server")) rc = server(argc, argv);
  else if (argc > 1 && !strcmp(argv[1], "client")) rc = client(argc, argv);
  if (rc == 2)
    fprintf(stderr, "usage: svc_app server PORT MODE [CERT KEY] | client ADDR PORT MODE N SIZE [CA]\n");
  return rc;
}
