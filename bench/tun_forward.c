/* A trivial TUN <-> TUN forwarder with read()/write(), one packet per system call and no offloads: the reference
 * the data-path benchmark compares flexstack's TUN faces with (scripts/bench-datapath.sh).
 * usage: tun_forward NAME_A NAME_B   (creates both devices, forwards until killed) */
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

static int open_tun(const char *name) {
    int fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC);
    if (fd < 0) { perror("open /dev/net/tun"); return -1; }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) { perror("TUNSETIFF"); return -1; }
    return fd;
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s NAME_A NAME_B\n", argv[0]); return 2; }
    int fd[2] = { open_tun(argv[1]), open_tun(argv[2]) };
    if (fd[0] < 0 || fd[1] < 0) return 1;
    printf("ready\n");
    fflush(stdout);
    static char buf[65536];
    struct pollfd p[2] = { { fd[0], POLLIN, 0 }, { fd[1], POLLIN, 0 } };
    for (;;) {
        if (poll(p, 2, -1) < 0) { perror("poll"); return 1; }
        for (int i = 0; i < 2; i++) {
            if (p[i].revents & POLLIN) {
                ssize_t n = read(fd[i], buf, sizeof buf);
                if (n > 0 && write(fd[1 - i], buf, (size_t)n) < 0) { /* dropped, as a full queue would */ }
            }
        }
    }
}
