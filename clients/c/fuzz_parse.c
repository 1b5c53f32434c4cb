/* Fuzz harness of the library's parser (tests/appvars_fuzz.rs builds it with the sanitizers and feeds it).
 * Reads records from stdin, each a 4-byte little-endian length and that many bytes: the bytes are what the
 * daemon could send. Each record goes through json_string() directly and, as lines on a socket, through
 * fs_app_poll() (read_line, handle_event, the knob callback, the ack). Prints "ok N" after N records. */
#include "flexstack_app.c"

static int on_set(fs_app *a, const char *name, const char *value, void *user) {
    (void)name;
    (void)user;
    if (strlen(value) > 3) fs_app_refuse(a, value);
    return value[0] == 'x';
}

int main(void) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return 2;
    fs_app *a = calloc(1, sizeof *a);
    if (!a) return 2;
    a->fd = sv[0];
    if (fs_app_knob(a, "cc", FS_STR, "cubic", on_set, NULL) || fs_app_knob(a, "level", FS_I64, NULL, NULL, NULL))
        return 2;
    a->registered = 1;
    static char input[60000 + 1], out[8192], drain[65536];
    unsigned long n = 0;
    unsigned char len4[4];
    while (fread(len4, 1, 4, stdin) == 4) {
        size_t len = (size_t)len4[0] | (size_t)len4[1] << 8 | (size_t)len4[2] << 16 | (size_t)len4[3] << 24;
        if (len > sizeof input - 1 || fread(input, 1, len, stdin) != len) return 3;
        input[len] = 0;
        char *exact = malloc(len + 1); /* exactly as long as the text, so that reading past its end is caught */
        if (!exact) return 2;
        memcpy(exact, input, len + 1);
        json_string(exact, "message", out, sizeof out);
        json_string(exact, "name", out, 8);
        json_string(exact, "text", out, 1);
        free(exact);
        if (send(sv[1], input, len, 0) != (ssize_t)len) return 4;
        if (send(sv[1], "\n", 1, 0) != 1) return 4;
        for (int i = 0; i < 64 && fs_app_poll(a, 0) < 0; i++) {
        }
        a->len = 0;
        while (recv(sv[1], drain, sizeof drain, MSG_DONTWAIT) > 0) {
        }
        n++;
    }
    printf("ok %lu\n", n);
    fs_app_close(a);
    close(sv[1]);
    return 0;
}
