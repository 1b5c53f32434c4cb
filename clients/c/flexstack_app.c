/* flexstack_app: see flexstack_app.h. Plain C99 and POSIX, no dependencies.
 *
 * JSON is written by hand (names are restricted to a-z 0-9 _, texts are escaped) and read only in the two
 * shapes the daemon sends on this socket: responses {"id":N,"ok":BOOL,...,"error":{"message":"..."}} and knob
 * writes {"event":{"name":"...","op":"set","serial":N,"text":"...","value":...}}; a general JSON parser would
 * be a dependency for no gain. */
#define _POSIX_C_SOURCE 200809L
#include "flexstack_app.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define FS_MAX_LINE 65536
#define FS_MAX_KNOBS 64
#define FS_REPLY_TIMEOUT_MS 5000

struct knob {
    char name[65];
    fs_set_cb cb;
    void *user;
};

struct fs_app {
    int fd;
    char err[512];
    char *decls; /* the "vars" array being built: "{...},{...}" */
    size_t decls_len;
    int nvars;
    struct knob knobs[FS_MAX_KNOBS];
    int nknobs;
    int registered;
    uint64_t next_id;
    char buf[FS_MAX_LINE + 1];
    size_t len;
    char refusal[256];
};

static int fail(fs_app *a, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->err, sizeof a->err, fmt, ap);
    va_end(ap);
    return -1;
}

static const char *type_name(fs_type t) {
    switch (t) {
    case FS_U64: return "u64";
    case FS_I64: return "i64";
    case FS_F64: return "f64";
    case FS_BOOL: return "bool";
    default: return "str";
    }
}

/* Appends `s` as a JSON string (quoted, escaped) to the growing buffer *out. */
static int append(char **out, size_t *len, const char *s, size_t n) {
    char *p = realloc(*out, *len + n + 1);
    if (!p) return -1;
    memcpy(p + *len, s, n);
    *len += n;
    p[*len] = 0;
    *out = p;
    return 0;
}

static int append_json_string(char **out, size_t *len, const char *s) {
    if (append(out, len, "\"", 1)) return -1;
    for (; *s; s++) {
        char esc[8];
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            if (append(out, len, esc, 2)) return -1;
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            if (append(out, len, esc, 6)) return -1;
        } else if (append(out, len, (const char *)&c, 1)) {
            return -1;
        }
    }
    return append(out, len, "\"", 1);
}

static int valid_name(const char *s, int allow_dash) {
    size_t n = strlen(s);
    if (n == 0 || n > 64) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '_' || (allow_dash && *s == '-')))
            return 0;
    return 1;
}

fs_app *fs_app_open(const char *socket_path) {
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    if (socket_path) {
        snprintf(path, sizeof path, "%s", socket_path);
    } else {
        const char *dir = getenv("FLEXSTACK_STATE_DIR");
        snprintf(path, sizeof path, "%s/apps.sock", dir && *dir ? dir : "/run/flexstack");
    }
    fs_app *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->next_id = 1;
    a->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    if (a->fd < 0 || connect(a->fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        int e = errno;
        if (a->fd >= 0) close(a->fd);
        free(a);
        errno = e;
        return NULL;
    }
    return a;
}

static int declare(fs_app *a, const char *kind, const char *name, fs_type type, const char *initial) {
    if (a->registered) return fail(a, "declare variables before fs_app_register");
    if (!valid_name(name, 0)) return fail(a, "invalid variable name \"%s\": expected 1-64 of a-z 0-9 _", name);
    char head[200];
    snprintf(head, sizeof head, "%s{\"name\":\"%s\",\"kind\":\"%s\",\"type\":\"%s\"", a->nvars ? "," : "", name,
             kind, type_name(type));
    if (append(&a->decls, &a->decls_len, head, strlen(head))) return fail(a, "out of memory");
    if (initial) {
        if (append(&a->decls, &a->decls_len, ",\"value\":", 9) || append_json_string(&a->decls, &a->decls_len, initial))
            return fail(a, "out of memory");
    }
    if (append(&a->decls, &a->decls_len, "}", 1)) return fail(a, "out of memory");
    a->nvars++;
    return 0;
}

int fs_app_meter(fs_app *a, const char *name, fs_type type) {
    return declare(a, "meter", name, type, NULL);
}

int fs_app_knob(fs_app *a, const char *name, fs_type type, const char *initial, fs_set_cb cb, void *user) {
    if (a->nknobs == FS_MAX_KNOBS) return fail(a, "at most %d knobs", FS_MAX_KNOBS);
    if (declare(a, "knob", name, type, initial)) return -1;
    struct knob *k = &a->knobs[a->nknobs++];
    snprintf(k->name, sizeof k->name, "%s", name);
    k->cb = cb;
    k->user = user;
    return 0;
}

static int send_all(fs_app *a, const char *s, size_t n) {
    while (n > 0) {
        ssize_t w = send(a->fd, s, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return fail(a, "send: %s", strerror(errno));
        s += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The next line (without its newline) into *line: 1, or 0 on timeout, or -1. The line stays valid until the
 * next call. */
static int read_line(fs_app *a, int timeout_ms, char **line) {
    static char out[FS_MAX_LINE + 1];
    for (;;) {
        char *nl = memchr(a->buf, '\n', a->len);
        if (nl) {
            size_t n = (size_t)(nl - a->buf);
            memcpy(out, a->buf, n);
            out[n] = 0;
            memmove(a->buf, nl + 1, a->len - n - 1);
            a->len -= n + 1;
            *line = out;
            return 1;
        }
        if (a->len == FS_MAX_LINE) return fail(a, "line from the daemon longer than %d bytes", FS_MAX_LINE);
        struct pollfd p = {.fd = a->fd, .events = POLLIN};
        int r = poll(&p, 1, timeout_ms);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return fail(a, "poll: %s", strerror(errno));
        if (r == 0) return 0;
        ssize_t got = recv(a->fd, a->buf + a->len, FS_MAX_LINE - a->len, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return fail(a, "the daemon closed the connection");
        a->len += (size_t)got;
    }
}

/* The JSON string after "key": in `line`, unescaped into out (\uXXXX below 0x80 only; others become '?'). */
static int json_string(const char *line, const char *key, char *out, size_t size) {
    char pat[80];
    snprintf(pat, sizeof pat, "\"%s\":\"", key);
    const char *p = strstr(line, pat);
    if (!p) return -1;
    p += strlen(pat);
    size_t n = 0;
    while (*p && *p != '"') {
        char c = *p++;
        if (c == '\\') {
            c = *p++;
            switch (c) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                unsigned v = 0;
                for (int i = 0; i < 4; i++) {
                    char h = p[i];
                    int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                            : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
                    if (d < 0) return -1; /* also stops at the end of the line */
                    v = v * 16 + (unsigned)d;
                }
                p += 4;
                c = v < 0x80 ? (char)v : '?';
                break;
            }
            case 0: return -1;
            default: break; /* \" \\ \/ */
            }
        }
        if (n + 1 < size) out[n++] = c;
    }
    out[n] = 0;
    return *p == '"' ? 0 : -1;
}

static int handle_event(fs_app *a, const char *line) {
    char name[80], text[4100], op[16];
    const char *s = strstr(line, "\"serial\":");
    if (!s || json_string(line, "op", op, sizeof op)) return fail(a, "unreadable event from the daemon: %.200s", line);
    uint64_t serial = strtoull(s + 9, NULL, 10);
    int ok = 0, ping = strcmp(op, "ping") == 0;
    if (!ping && (json_string(line, "name", name, sizeof name) || json_string(line, "text", text, sizeof text)))
        return fail(a, "unreadable event from the daemon: %.200s", line);
    a->refusal[0] = 0;
    if (ping) ok = 1; /* the daemon checks that the app is alive: ack it */
    for (int i = 0; !ping && i < a->nknobs; i++) {
        if (strcmp(a->knobs[i].name, name) == 0) {
            ok = a->knobs[i].cb ? a->knobs[i].cb(a, name, text, a->knobs[i].user) == 0 : 1;
            if (!ok && !a->refusal[0]) snprintf(a->refusal, sizeof a->refusal, "refused");
            break;
        }
    }
    char *ack = NULL;
    size_t len = 0;
    char head[120];
    snprintf(head, sizeof head, "{\"op\":\"ack\",\"serial\":%" PRIu64 ",\"ok\":%s", serial, ok ? "true" : "false");
    int e = append(&ack, &len, head, strlen(head));
    if (!ok && !e) e = append(&ack, &len, ",\"error\":", 9) || append_json_string(&ack, &len, a->refusal);
    if (!e) e = append(&ack, &len, "}\n", 2);
    int r = e ? fail(a, "out of memory") : send_all(a, ack, len);
    free(ack);
    return r;
}

/* Sends one request (a JSON object without its closing brace) and waits for its response, running the
 * callbacks of knob writes that arrive meanwhile. */
static int request(fs_app *a, char *body, size_t len) {
    char tail[40];
    snprintf(tail, sizeof tail, ",\"id\":%" PRIu64 "}\n", a->next_id++);
    if (append(&body, &len, tail, strlen(tail))) return fail(a, "out of memory");
    int r = send_all(a, body, len);
    free(body);
    if (r) return -1;
    for (;;) {
        char *line;
        int got = read_line(a, FS_REPLY_TIMEOUT_MS, &line);
        if (got < 0) return -1;
        if (got == 0) return fail(a, "no answer from the daemon within %d ms", FS_REPLY_TIMEOUT_MS);
        if (strstr(line, "\"event\":")) {
            if (handle_event(a, line)) return -1;
            continue;
        }
        if (strstr(line, "\"ok\":true")) return 0;
        char msg[400];
        if (json_string(line, "message", msg, sizeof msg)) snprintf(msg, sizeof msg, "%.300s", line);
        return fail(a, "%s", msg);
    }
}

int fs_app_register(fs_app *a, const char *name) {
    if (a->registered) return fail(a, "registered already");
    if (!valid_name(name, 1)) return fail(a, "invalid application name \"%s\": expected 1-64 of a-z 0-9 _ -", name);
    char *body = NULL;
    size_t len = 0;
    char head[120];
    snprintf(head, sizeof head, "{\"op\":\"register\",\"app\":\"%s\",\"vars\":[", name);
    if (append(&body, &len, head, strlen(head)) || (a->decls && append(&body, &len, a->decls, a->decls_len)) ||
        append(&body, &len, "]", 1)) {
        free(body);
        return fail(a, "out of memory");
    }
    if (request(a, body, len)) return -1;
    a->registered = 1;
    return 0;
}

static int update(fs_app *a, const char *name, const char *json_value) {
    if (!a->registered) return fail(a, "register first");
    char *body = NULL;
    size_t len = 0;
    if (append(&body, &len, "{\"op\":\"update\",\"name\":", 22) || append_json_string(&body, &len, name) ||
        append(&body, &len, ",\"value\":", 9) || append(&body, &len, json_value, strlen(json_value))) {
        free(body);
        return fail(a, "out of memory");
    }
    return request(a, body, len);
}

int fs_app_update_u64(fs_app *a, const char *name, uint64_t v) {
    char s[32];
    snprintf(s, sizeof s, "%" PRIu64, v);
    return update(a, name, s);
}

int fs_app_update_i64(fs_app *a, const char *name, int64_t v) {
    char s[32];
    snprintf(s, sizeof s, "%" PRId64, v);
    return update(a, name, s);
}

int fs_app_update_f64(fs_app *a, const char *name, double v) {
    char s[40];
    snprintf(s, sizeof s, "%.17g", v);
    if (strspn(s, "-0123456789.e+") != strlen(s)) return fail(a, "%s: not a finite number", name);
    return update(a, name, s);
}

int fs_app_update_text(fs_app *a, const char *name, const char *v) {
    char *quoted = NULL;
    size_t len = 0;
    if (append_json_string(&quoted, &len, v)) return fail(a, "out of memory");
    int r = update(a, name, quoted);
    free(quoted);
    return r;
}

int fs_app_poll(fs_app *a, int timeout_ms) {
    int handled = 0;
    for (;;) {
        char *line;
        int got = read_line(a, handled ? 0 : timeout_ms, &line);
        if (got < 0) return -1;
        if (got == 0) return handled;
        if (strstr(line, "\"event\":")) {
            if (handle_event(a, line)) return -1;
            handled++;
        }
    }
}

void fs_app_refuse(fs_app *a, const char *reason) {
    snprintf(a->refusal, sizeof a->refusal, "%s", reason);
}

int fs_app_fd(const fs_app *a) {
    return a->fd;
}

const char *fs_app_error(const fs_app *a) {
    return a->err;
}

void fs_app_close(fs_app *a) {
    if (!a) return;
    close(a->fd);
    free(a->decls);
    free(a);
}
